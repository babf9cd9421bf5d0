"""Record retention: compacting the bodies of inference records that were consumed, expired or over budget.

Eligibility (the one rule, for ``reef gc --records`` and the server's background pass alike). Only ``inference``
records are compacted; reports (scores, feedback) and instructions are kept whole. An inference record whose body
is still whole is compacted for the first reason that holds:

* ``consumed``: a committed step consumed it (its id is in ``consumed_ids``), so it never trains again;
* ``expired``: it is older than the scenario's ``max_age``;
* ``max_bytes``: its scenario's (or, all scenarios together, the deployment's) inference bodies exceed the budget
  after the two above; the oldest eligible bodies go first.

and none of these protects it:

* ``keep_scored`` and a report quotes it (a scored record keeps its body);
* a report that no step consumed quotes it: a pending sample, or a held-out task of the replay set, may still be
  built from it (whether or not a processor already formed the unit: this is what a restart rebuilds);
* the live processors hold it (``protected(scenario)``: pending units and the reserved batch; the server's pass
  asks its learners, ``reef gc --records`` run alone has no live processor and relies on the two rules above).

Crash safety: the plan is read without locks; each chunk of ``chunk_records`` records is one write transaction on
the store's writer that re-reads its rows, skips those already compacted (a rerun after a crash is idempotent),
re-checks the protection against reports stored since the plan (on PostgreSQL after locking the scenario's sequence
row, which every append of the scenario takes, so no report slips in between) and the live processors, rewrites the
payloads and adds to the ``record_compactions`` counts in the same transaction. A kill mid-pass leaves whole chunks
compacted and counted, and everything else as it was.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import sqlalchemy as sa

from reef_core.observe import queries as q
from reef_core.observe.batch import row_to_record
from reef_core.observe.compacted import MARKER, REASONS, is_compacted, stub_payload
from reef_core.observe.records import RecordStore
from reef_core.observe.schema import record_compactions, record_sequences, records

Protected = Callable[[str], Iterable[str]]


@dataclass(frozen=True)
class CompactionPolicy:
    """One scenario's record retention: ``max_age_s`` (None: forever), its own body budget, ``keep_scored``."""

    max_age_s: float | None = None
    max_bytes: int | None = None
    keep_scored: bool = True


@dataclass(frozen=True)
class Candidate:
    scenario: str
    record_id: str
    sequence: int
    created_at: float
    body_bytes: int
    reason: str


@dataclass
class CompactionPlan:
    """What a pass would compact, in order (per scenario: consumed, expired, then over budget, oldest first)."""

    candidates: list[Candidate]
    #: report sequence per scenario up to which the plan's protection was computed
    planned_at: dict[str, int]
    #: eligible records left for a later pass by ``limit``
    deferred: int = 0
    #: inference body bytes not yet compacted, per scenario, when planned
    body_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class CompactionResult:
    """Per scenario and reason: records compacted (or, dry run, that would be) and body bytes before and after."""

    counts: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    skipped: int = 0  # planned records found compacted or protected inside their transaction
    chunks: int = 0

    def add(self, scenario: str, reason: str, before: int, after: int) -> None:
        row = self.counts.setdefault(scenario, {}).setdefault(reason, {"records": 0, "bytes_before": 0,
                                                                       "bytes_after": 0})
        row["records"] += 1
        row["bytes_before"] += before
        row["bytes_after"] += after

    def total(self, key: str = "records") -> int:
        return sum(row[key] for reasons in self.counts.values() for row in reasons.values())


# -- planning ---------------------------------------------------------------------------------------------------


def _body_size(dialect: str):
    if dialect == "postgresql":
        return (sa.func.octet_length(sa.cast(records.c.payload, sa.Text))
                + sa.func.coalesce(sa.func.octet_length(records.c.top_k), 0))
    return (sa.func.length(sa.cast(records.c.payload, sa.LargeBinary))
            + sa.func.coalesce(sa.func.length(records.c.top_k), 0))


def _marker(dialect: str):
    if dialect == "postgresql":
        return sa.func.json_typeof(records.c.payload.op("->")(MARKER))
    return sa.func.json_type(records.c.payload, f"$.{MARKER}")


_REPORTS = (sa.select(records.c.record_id, records.c.references, records.c.sequence)
            .where(records.c.scenario == sa.bindparam("scenario"), records.c.kind == "report",
                   records.c.sequence > sa.bindparam("after")))


def _json_list(value) -> list:
    return json.loads(value) if isinstance(value, str) else list(value or [])


def _quoted(conn: sa.Connection, scenario: str, after: int, consumed: set[str]) -> tuple[set[str], set[str], int]:
    """(ids any report after ``after`` quotes, ids an unconsumed one quotes, the last report sequence seen)."""
    scored: set[str] = set()
    held: set[str] = set()
    last = after
    for row in conn.execute(_REPORTS, {"scenario": scenario, "after": after}):
        refs = _json_list(row.references)
        scored.update(refs)
        if row.record_id not in consumed:
            held.update(refs)
        last = max(last, int(row.sequence))
    return scored, held, last


def plan_compaction(store: RecordStore, policies: dict[str, CompactionPolicy], *, total_max_bytes: int | None = None,
                    protected: Protected | None = None, now: float | None = None,
                    limit: int | None = None) -> CompactionPlan:
    """The records one pass compacts, for the scenarios of ``policies`` (see the module docstring)."""
    now = time.time() if now is None else now
    engine = store.sql_engine
    plan = CompactionPlan(candidates=[], planned_at={})
    pools: list[Candidate] = []  # eligible for a budget only, oldest first per scenario
    remaining_total = 0
    size, marker = _body_size(store.dialect), _marker(store.dialect)
    scan = (sa.select(records.c.record_id, records.c.sequence, records.c.created_at, size.label("body_bytes"))
            .where(records.c.scenario == sa.bindparam("scenario"), records.c.kind == "inference",
                   marker.is_(None))
            .order_by(records.c.sequence))
    for scenario, policy in sorted(policies.items()):
        consumed = store.consumed_ids(scenario)
        with engine.connect() as conn:
            last = int(conn.execute(q.LAST_SEQUENCE, {"scenario": scenario}).scalar_one() or 0)
            scored, held, _ = _quoted(conn, scenario, 0, consumed)
            rows = conn.execute(scan, {"scenario": scenario}).all()
        plan.planned_at[scenario] = last
        keep = set(held) | set(protected(scenario) if protected is not None else ())
        if policy.keep_scored:
            keep |= scored
        expiry = now - policy.max_age_s if policy.max_age_s is not None else None
        remaining = 0
        chosen: list[Candidate] = []
        pool: list[Candidate] = []
        for row in rows:
            body = int(row.body_bytes or 0)
            remaining += body
            if int(row.sequence) > last or row.record_id in keep:
                continue
            if row.record_id in consumed:
                reason = "consumed"
            elif expiry is not None and float(row.created_at) < expiry:
                reason = "expired"
            else:
                pool.append(Candidate(scenario, row.record_id, int(row.sequence), float(row.created_at), body,
                                      "max_bytes"))
                continue
            chosen.append(Candidate(scenario, row.record_id, int(row.sequence), float(row.created_at), body, reason))
            remaining -= body
        plan.body_bytes[scenario] = sum(int(r.body_bytes or 0) for r in rows)
        chosen.sort(key=lambda c: (REASONS.index(c.reason), c.sequence))
        if policy.max_bytes is not None:
            while pool and remaining > policy.max_bytes:
                taken = pool.pop(0)
                chosen.append(taken)
                remaining -= taken.body_bytes
        plan.candidates.extend(chosen)
        pools.extend(pool)
        remaining_total += remaining
    if total_max_bytes is not None and remaining_total > total_max_bytes:
        for taken in sorted(pools, key=lambda c: (c.created_at, c.scenario, c.sequence)):
            if remaining_total <= total_max_bytes:
                break
            plan.candidates.append(taken)
            remaining_total -= taken.body_bytes
    if limit is not None and len(plan.candidates) > limit:
        plan.deferred = len(plan.candidates) - limit
        plan.candidates = plan.candidates[:limit]
    return plan


# -- running ----------------------------------------------------------------------------------------------------


_ROWS = sa.select(records).where(records.c.scenario == sa.bindparam("scenario"),
                                 records.c.record_id.in_(sa.bindparam("ids", expanding=True)))
_REWRITE = (sa.update(records)
            .where(records.c.scenario == sa.bindparam("s"), records.c.record_id == sa.bindparam("rid"))
            .values(payload=sa.bindparam("stub"), top_k=None))
_LOCK_SEQUENCE = (sa.select(record_sequences.c.last_sequence)
                  .where(record_sequences.c.scenario == sa.bindparam("scenario")).with_for_update())
COUNTS = sa.select(record_compactions)


def _stored_bytes(record) -> int:
    text = json.dumps(record.payload, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode()) + len(record.top_k or b"")


def _add_counts(conn: sa.Connection, dialect: str, scenario: str, rows: dict[str, dict[str, int]]) -> None:
    insert = q.dialect_insert(dialect, record_compactions)
    stmt = insert.on_conflict_do_update(
        index_elements=[record_compactions.c.scenario, record_compactions.c.reason],
        set_={"records": record_compactions.c.records + insert.excluded.records,
              "bytes_before": record_compactions.c.bytes_before + insert.excluded.bytes_before,
              "bytes_after": record_compactions.c.bytes_after + insert.excluded.bytes_after,
              "updated_at": insert.excluded.updated_at})
    now = time.time()
    conn.execute(stmt, [{"scenario": scenario, "reason": reason, "updated_at": now, **row}
                        for reason, row in rows.items()])


def _chunks(plan: CompactionPlan, size: int):
    """Runs of at most ``size`` candidates of one scenario, in plan order."""
    run: list[Candidate] = []
    for candidate in plan.candidates:
        if run and (len(run) >= size or run[0].scenario != candidate.scenario):
            yield run
            run = []
        run.append(candidate)
    if run:
        yield run


def run_compaction(store: RecordStore, plan: CompactionPlan, *, chunk_records: int = 500, dry_run: bool = False,
                   protected: Protected | None = None, in_chunk: Callable[[], None] | None = None,
                   after_chunk: Callable[[int], None] | None = None) -> CompactionResult:
    """Compact ``plan``'s records chunk by chunk, one transaction each (``dry_run``: read and measure only).

    ``in_chunk`` runs inside each chunk's transaction before it commits, ``after_chunk(records_so_far)`` after it
    committed: crash points for tests, progress for the CLI."""
    result = CompactionResult()
    dialect = store.dialect

    def compact(conn: sa.Connection, chunk: list[Candidate]) -> list[tuple[str, str, int, int]]:
        scenario = chunk[0].scenario
        if dialect == "postgresql" and not dry_run:
            conn.execute(_LOCK_SEQUENCE, {"scenario": scenario}).first()
        # Reports stored since the plan: whatever they quote may become a sample (none of them is consumed yet).
        quoted, _, _ = _quoted(conn, scenario, plan.planned_at.get(scenario, 0), set())
        keep = quoted | set(protected(scenario) if protected is not None else ())
        found = {row.record_id: row_to_record(row)
                 for row in conn.execute(_ROWS, {"scenario": scenario, "ids": [c.record_id for c in chunk]})}
        done, updates, now = [], [], time.time()
        for candidate in chunk:
            record = found.get(candidate.record_id)
            if record is None or record.kind != "inference" or is_compacted(record) \
                    or candidate.record_id in keep:
                continue
            before = _stored_bytes(record)
            stub = stub_payload(record.payload, at=now, reason=candidate.reason, body_bytes=before)
            after = len(json.dumps(stub, ensure_ascii=False, separators=(",", ":")).encode())
            updates.append({"s": scenario, "rid": candidate.record_id, "stub": stub})
            done.append((scenario, candidate.reason, before, after))
        if updates and not dry_run:
            conn.execute(_REWRITE, updates)
            sums: dict[str, dict[str, int]] = {}
            for _, reason, before, after in done:
                row = sums.setdefault(reason, {"records": 0, "bytes_before": 0, "bytes_after": 0})
                row["records"] += 1
                row["bytes_before"] += before
                row["bytes_after"] += after
            _add_counts(conn, dialect, scenario, sums)
            if in_chunk is not None:
                in_chunk()
        return done

    for chunk in _chunks(plan, chunk_records):
        if dry_run:
            with store.sql_engine.connect() as conn:
                done = compact(conn, chunk)
        else:
            done = store.write_transaction(lambda conn, chunk=chunk: compact(conn, chunk))
        result.chunks += 1
        result.skipped += len(chunk) - len(done)
        for scenario, reason, before, after in done:
            result.add(scenario, reason, before, after)
        if after_chunk is not None:
            after_chunk(result.total())
    return result


def compaction_counts(store: RecordStore) -> dict[str, dict[str, dict[str, int]]]:
    """Records compacted so far, per scenario and reason, with their body bytes before and after (every process's
    passes: the counts live in the store)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    with store.sql_engine.connect() as conn:
        for row in conn.execute(COUNTS):
            out.setdefault(row.scenario, {})[row.reason] = {
                "records": int(row.records), "bytes_before": int(row.bytes_before),
                "bytes_after": int(row.bytes_after)}
    return out
