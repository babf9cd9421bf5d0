"""Record store size before and after retention's compaction, SQLite and PostgreSQL.

Writes ``--records`` inference records (about 2 KB of chat bodies plus token ids and a packed top-K column, like one
served turn) through the store's write path in batches of 500, a report quoting every tenth (scored), marks a fifth
consumed and backdates ``--expired-share`` of them past ``max_age=30d``; then runs one retention pass
(``keep_scored=true``, the defaults) and measures the store before and after: SQLite the file size after a WAL
checkpoint and ``VACUUM``, PostgreSQL ``pg_total_relation_size`` of the records table after ``VACUUM FULL``. Every run
checks that no receipt, report or scored body was lost.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path

from bench import common
from bench.store import PG_URL, _drop_schema, _payload, _postgres_up

BATCH = 500
DAY = 86400


def add_arguments(parser) -> None:
    parser.add_argument("--records", type=int, default=100_000, help="inference records per backend (default 100k)")
    parser.add_argument("--expired-share", type=float, default=0.5, help="share backdated past max_age (0.5)")
    parser.add_argument("--backends", default="sqlite,postgres", help="sqlite,postgres")
    parser.add_argument("--pg-url", default=PG_URL)


def _records(count: int, expired_share: float):
    from reef_core.observe.model import Record

    now = time.time()
    expired_every = round(1 / expired_share) if expired_share > 0 else 0
    for i in range(count):
        payload = _payload(i)
        payload["tokens"] = {"prompt_ids": list(range(1000, 1150)), "output_ids": list(range(2000, 2151)),
                             "output_logprobs": [-0.25] * 151, "version": "bench:1"}
        old = expired_every and i % expired_every == 0
        yield Record(record_id=f"r{i}", scenario="bench", kind="inference", payload=payload, tags={"bench": "ret"},
                     created_at=now - (40 * DAY if old else 60), top_k=bytes(151 * 8))


def _fill(store, count: int, expired_share: float) -> dict:
    from reef_core.observe.model import Record

    store.get_or_create_scenario("bench", "none")
    started = time.perf_counter()
    batch: list = []
    for record in _records(count, expired_share):
        batch.append(record)
        if len(batch) == BATCH:
            store.append_many_sync(batch)
            batch = []
    if batch:
        store.append_many_sync(batch)
    reports = [Record(record_id=f"rep{i}", scenario="bench", kind="report", payload={"score": 1.0},
                      references=[f"r{i}"]) for i in range(0, count, 10)]
    for start in range(0, len(reports), BATCH):
        store.append_many_sync(reports[start:start + BATCH])
    consumed = [f"r{i}" for i in range(count) if i % 5 == 1] + [r.record_id for r in reports]
    store.mark_consumed("bench", consumed, step=1)
    return {"write_s": round(time.perf_counter() - started, 1), "reports": len(reports)}


def _compact(store) -> tuple[dict, float]:
    from reef_core.observe.compaction import CompactionPolicy, plan_compaction, run_compaction

    started = time.perf_counter()
    plan = plan_compaction(store, {"bench": CompactionPolicy(max_age_s=30 * DAY, keep_scored=True)})
    result = run_compaction(store, plan, chunk_records=500)
    return result.counts.get("bench", {}), round(time.perf_counter() - started, 1)


def _sqlite_size(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages, size = conn.execute("PRAGMA page_count").fetchone()[0], conn.execute("PRAGMA page_size").fetchone()[0]
    finally:
        conn.close()
    return pages * size


def _pg_size(url: str, schema: str) -> int:
    import sqlalchemy as sa

    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'VACUUM FULL "{schema}".records')
            return int(conn.exec_driver_sql(f"SELECT pg_total_relation_size('\"{schema}\".records')").scalar_one())
    finally:
        engine.dispose()


def _check(store, count: int, reports: int) -> list[str]:
    from reef_core.observe.compacted import is_compacted

    problems, kinds, scored_compacted = [], {"inference": 0, "report": 0}, 0
    for record in store.replay("bench"):
        kinds[record.kind] += 1
        if record.kind == "inference" and int(record.record_id[1:]) % 10 == 0 and is_compacted(record):
            scored_compacted += 1
    if kinds != {"inference": count, "report": reports}:
        problems.append(f"stored {kinds}, expected {count} inferences and {reports} reports")
    if scored_compacted:
        problems.append(f"{scored_compacted} scored bodies compacted")
    return problems


def _run_backend(backend: str, args, workdir: Path) -> dict:
    from reef_core.observe.records import RecordStore

    schema = f"bench_{uuid.uuid4().hex[:12]}" if backend == "postgres" else None
    url = args.pg_url if backend == "postgres" else None
    options = {"schema": schema} if schema else {}

    def size() -> int:
        return _pg_size(url, schema) if schema else _sqlite_size(workdir / "records.db")

    try:
        with RecordStore.open(url, workdir, **options) as store:
            filled = _fill(store, args.records, args.expired_share)
        before = size()
        with RecordStore.open(url, workdir, **options) as store:
            counts, compact_s = _compact(store)
            problems = _check(store, args.records, filled["reports"])
        after = size()
    finally:
        if schema is not None:
            _drop_schema(url, schema)
    compacted = sum(row["records"] for row in counts.values())
    return {"backend": backend, "records": args.records, **filled, "compacted": compacted,
            "by_reason": {reason: row["records"] for reason, row in counts.items()},
            "compact_s": compact_s, "records_per_s": round(compacted / compact_s) if compact_s else None,
            "bytes_before": before, "bytes_after": after, "ratio": round(after / before, 3),
            "problems": problems}


def run(args) -> dict:
    machine = common.machine()
    runs, skipped = [], {}
    for backend in args.backends.split(","):
        if backend not in ("sqlite", "postgres"):
            raise SystemExit(f"unknown backend {backend!r}")
        if backend == "postgres" and not _postgres_up(args.pg_url):
            skipped[backend] = f"PostgreSQL not reachable at {args.pg_url}"
            continue
        workdir = Path(tempfile.mkdtemp(prefix="reef-bench-retention-"))
        try:
            runs.append(_run_backend(backend, args, workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    mib = 1024 * 1024
    print(common.table(["backend", "records", "compacted", "consumed", "expired", "write s", "compact s",
                        "records/s", "MiB before", "MiB after", "after/before"],
                       [[r["backend"], r["records"], r["compacted"], r["by_reason"].get("consumed", 0),
                         r["by_reason"].get("expired", 0), r["write_s"], r["compact_s"], r["records_per_s"],
                         round(r["bytes_before"] / mib, 1), round(r["bytes_after"] / mib, 1), r["ratio"]]
                        for r in runs]))
    load_end = round(os.getloadavg()[0], 2)
    print(f"1-minute load: {machine['load_avg_1m_at_start']} at start, {load_end} at end")
    for backend, why in skipped.items():
        print(f"skipped {backend}: {why}")
    problems = [f"{r['backend']}: {p}" for r in runs for p in r["problems"]]
    for problem in problems:
        print("PROBLEM:", problem)
    return {"machine": machine, "load_avg_1m_at_end": load_end, "runs": runs, "skipped": skipped,
            "problems": problems}
