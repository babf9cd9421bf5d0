"""What one write transaction of the record store does with a batch of append requests.

All decisions that depend on stored state (deduplication, conflicts, idempotency keys, reference checks) are made in
Python against rows read inside the same transaction, so a request that is refused (``Conflict``,
``ValidationFailed``) does not abort the transaction the other requests of the batch share. Only a database error
aborts the batch; the writer then retries the requests one by one (see :mod:`reef_core.observe.writer`).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import sqlalchemy as sa

from reef_core.errors import Conflict, ReefError, ValidationFailed
from reef_core.observe import queries as q
from reef_core.observe.model import Record, payload_checked
from reef_core.observe.schema import record_sequences, records

# Stay far below SQLite's bound-parameter limit and keep PostgreSQL IN lists cheap.
IN_CHUNK = 500

Key = tuple[str, str]  # (scenario, record_id): record ids are scenario-scoped (#37 D5)


def key_of(record: Record) -> Key:
    return (record.scenario, record.record_id)


@dataclass
class AppendRequest:
    """One caller's append: a single record (optionally under an idempotency key) or an all-or-nothing group."""

    records: list[Record]
    idempotency_key: str | None = None
    check_references: bool = False
    #: create the records' scenario bound to this recipe, in the same transaction, if the request is accepted and
    #: the scenario does not exist yet (a refused request creates nothing)
    new_scenario_recipe: str | None = None
    #: filled by the writer: the stored records, or the error to raise in the caller
    outcome: list[Record] | BaseException | None = field(default=None, repr=False)


def _json_value(value: Any) -> Any:
    # Driver-level reads: SQLite hands JSON columns back as text, psycopg already decoded (lists/dicts, never str).
    return json.loads(value) if isinstance(value, str) else value


def row_to_record(row: Any) -> Record:
    """Build a :class:`Record` from a full ``records`` row."""
    return Record(
        record_id=row.record_id,
        scenario=row.scenario,
        kind=row.kind,
        payload=_json_value(row.payload),
        references=list(_json_value(row.references)),
        tags=dict(_json_value(row.tags)),
        version=row.version,
        complete=bool(row.complete),
        request_hash=row.request_hash,
        content_hash=row.content_hash,
        sequence=int(row.sequence),
        created_at=float(row.created_at),
        top_k=bytes(row.top_k) if row.top_k is not None else None,  # psycopg hands back memoryview
    )


_STORED_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _stored_json(value: Any, checked: bool) -> str:
    """Compact JSON text of a column value. A value ``canonical_json`` already accepted (``checked``) goes through
    orjson, about ten times faster; orjson would write NaN as null instead of refusing it, hence only then. What
    orjson refuses and the standard encoder takes (integer keys, integers beyond 64 bits) falls back to the latter.
    Number spellings may differ (``1e-5`` vs ``1e-05``); the values read back are the same."""
    if checked:
        try:
            return orjson.dumps(value).decode()
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            pass
    return _STORED_JSON.encode(value)


def encode_json_columns(record: Record) -> tuple[str, str, str]:
    """The JSON columns (references, tags, payload) as text; ``ValidationFailed`` when a value is not JSON, so a
    bad record (one built with a precomputed hash skips the check) fails alone instead of its whole batch."""
    checked = payload_checked(record)
    try:
        return (_stored_json(record.references, True) if record.references else "[]",  # strings: Record checks
                _stored_json(record.tags, True) if record.tags else "{}",  # tags: always checked by Record
                _stored_json(record.payload, checked))
    except (TypeError, ValueError) as exc:
        raise ValidationFailed(f"record {record.record_id!r} is not storable as JSON: {exc}") from exc


def record_to_params(record: Record, sequence: int, encoded: tuple[str, str, str]) -> tuple:
    """A ``records`` row as driver parameters, in table column order."""
    return (record.record_id, record.scenario, record.kind, sequence, record.created_at, record.version,
            record.complete, record.request_hash, record.content_hash, *encoded, record.top_k)


@dataclass(frozen=True)
class _DriverSql:
    """Driver-level SQL of the writer's hot statements for one connection's dialect and schema.

    ``exec_driver_sql`` skips SQLAlchemy's statement compilation, cache-key and per-row parameter processing, which
    cost more CPU than SQLite takes to run these statements and compete for the GIL with the callers' event loop.
    Database errors are still wrapped as ``sa.exc.DBAPIError`` (the writer's retry logic relies on that).
    """

    insert_records: str
    copy_records: str  # PostgreSQL: COPY ... FROM STDIN of the same columns
    select_by_ids: str  # "{marks}" is replaced by one placeholder per id
    select_by_keys: str  # PostgreSQL: the rows of (record_id[], scenario[]) arrays, joined on the primary key
    kinds_by_keys: str  # the same, record_id, scenario and kind only
    reserve_sequence: str
    mark: str


_SQL_CACHE: dict[tuple[str, str | None], _DriverSql] = {}


def _driver_sql(conn: sa.Connection) -> _DriverSql:
    schema = (conn.get_execution_options().get("schema_translate_map") or {}).get(None)
    key = (conn.dialect.name, schema)
    found = _SQL_CACHE.get(key)
    if found is not None:
        return found
    prep = conn.dialect.identifier_preparer

    def table(t: sa.Table) -> str:
        name = prep.quote(t.name)
        return f"{prep.quote_schema(schema)}.{name}" if schema is not None else name

    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    columns = ", ".join(prep.quote(column.name) for column in records.columns)
    seq = table(record_sequences)
    # The planner knows the join on both primary-key columns finds at most one row per key and searches the index;
    # for "record_id IN (...)" on a table without fresh statistics (a new store, one growing fast) it estimated
    # a third of the table and scanned all of it, per batch.
    by_keys = (f"FROM unnest({mark}::text[], {mark}::text[]) AS k(record_id, scenario) JOIN {table(records)} AS r "
               f"ON r.record_id = k.record_id AND r.scenario = k.scenario")
    found = _DriverSql(
        insert_records=f"INSERT INTO {table(records)} ({columns}) VALUES ({', '.join([mark] * len(records.columns))})",
        copy_records=f"COPY {table(records)} ({columns}) FROM STDIN",
        select_by_ids=f"SELECT {columns} FROM {table(records)} WHERE {prep.quote('record_id')} IN ({{marks}})",
        select_by_keys=f"SELECT {', '.join('r.' + prep.quote(c.name) for c in records.columns)} {by_keys}",
        kinds_by_keys=f"SELECT r.record_id, r.scenario, r.kind {by_keys}",
        # Same upsert as queries.reserve_sequences: the counter row's lock keeps concurrent writers apart.
        reserve_sequence=(f"INSERT INTO {seq} (scenario, last_sequence) VALUES ({mark}, {mark}) "
                          f"ON CONFLICT (scenario) DO UPDATE SET last_sequence = {seq}.last_sequence + "
                          f"excluded.last_sequence RETURNING last_sequence"),
        mark=mark,
    )
    _SQL_CACHE[key] = found
    return found


_RecordRow = namedtuple("_RecordRow", [column.name for column in records.columns])


def _sqlite_cursor_call(conn: sa.Connection, method: str, sql: str, params: Any):
    """Run ``cursor.<method>(sql, params)`` on SQLite's own cursor inside the connection's transaction.

    Even ``exec_driver_sql`` builds a result object and column metadata per statement, which costs more than SQLite
    takes to run it. Driver errors are wrapped as SQLAlchemy's ``DBAPIError`` subclasses, as ``exec_driver_sql``
    would, so the writer's rollback-and-retry logic sees the same exceptions.
    """
    cursor = conn.connection.driver_connection.cursor()
    try:
        getattr(cursor, method)(sql, params)
        return cursor
    except sqlite3.Error as exc:
        cursor.close()
        raise sa.exc.DBAPIError.instance(sql, params, exc, sqlite3.Error) from exc


def _select_rows(conn: sa.Connection, sql: str, params: tuple) -> list:
    if conn.dialect.name == "sqlite":
        cursor = _sqlite_cursor_call(conn, "execute", sql, params)
        try:
            return [_RecordRow._make(row) for row in cursor.fetchall()]
        finally:
            cursor.close()
    return list(conn.exec_driver_sql(sql, params))


def _scalar(conn: sa.Connection, sql: str, params: tuple) -> Any:
    if conn.dialect.name == "sqlite":
        cursor = _sqlite_cursor_call(conn, "execute", sql, params)
        try:
            rows = cursor.fetchall()
        finally:
            cursor.close()
        if len(rows) != 1:
            raise sa.exc.NoResultFound("expected exactly one row") if not rows else sa.exc.MultipleResultsFound(
                "expected exactly one row")
        return rows[0][0]
    return conn.exec_driver_sql(sql, params).scalar_one()


def _insert_records(conn: sa.Connection, rows: list[tuple]) -> None:
    """Insert ``records`` rows: SQLite's ``executemany`` steps one prepared statement in C. On PostgreSQL ``COPY``
    streams the rows in one command; psycopg's ``executemany`` binds and sends a statement per row, and a multi-row
    ``INSERT`` is parsed by psycopg anew per batch: both cost several times more CPU per row than the server."""
    sql = _driver_sql(conn)
    if conn.dialect.name == "sqlite":
        _sqlite_cursor_call(conn, "executemany", sql.insert_records, rows).close()
        return
    import psycopg  # the PostgreSQL store's driver (extra "postgres")

    try:
        with conn.connection.driver_connection.cursor() as cursor, cursor.copy(sql.copy_records) as copy:
            for row in rows:
                copy.write_row(row)
    except psycopg.Error as exc:  # wrapped as exec_driver_sql would: the writer retries on DBAPIError
        raise sa.exc.DBAPIError.instance(sql.copy_records, None, exc, psycopg.Error) from exc


def _chunks(items: Sequence, size: int = IN_CHUNK) -> Iterable[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _pg_by_keys(conn: sa.Connection, sql: str, wanted: set[Key]) -> Iterator:
    """PostgreSQL rows of ``sql`` (one of the ``*_by_keys`` statements) for ``wanted`` keys, chunk by chunk."""
    for chunk in _chunks(sorted(wanted)):
        yield from conn.exec_driver_sql(sql, ([rid for _, rid in chunk], [scenario for scenario, _ in chunk]))


def fetch_records(conn: sa.Connection, keys: Iterable[Key]) -> dict[Key, Record]:
    """Stored records among ``keys`` (``(scenario, record_id)``), by key."""
    wanted = set(keys)
    found: dict[Key, Record] = {}
    sql = _driver_sql(conn)
    if conn.dialect.name == "postgresql":
        for row in _pg_by_keys(conn, sql.select_by_keys, wanted):
            found[(row.scenario, row.record_id)] = row_to_record(row)
        return found
    for chunk in _chunks(sorted({rid for _, rid in wanted})):
        text = sql.select_by_ids.replace("{marks}", ", ".join([sql.mark] * len(chunk)))
        for row in _select_rows(conn, text, tuple(chunk)):
            if (row.scenario, row.record_id) in wanted:  # the same id in another scenario is another record
                found[(row.scenario, row.record_id)] = row_to_record(row)
    return found


def fetch_ref_info(conn: sa.Connection, keys: Iterable[Key]) -> dict[Key, str]:
    """The kind of the stored records among ``keys`` (no payloads read)."""
    wanted = set(keys)
    found: dict[Key, str] = {}
    if conn.dialect.name == "postgresql":
        for row in _pg_by_keys(conn, _driver_sql(conn).kinds_by_keys, wanted):
            found[(row.scenario, row.record_id)] = row.kind
        return found
    for chunk in _chunks(sorted({rid for _, rid in wanted})):
        for row in conn.execute(q.REF_INFO_BY_ID, {"ids": list(chunk)}):
            if (row.scenario, row.record_id) in wanted:
                found[(row.scenario, row.record_id)] = row.kind
    return found


def validate_references(scenario: str, ids: Any, lookup: Callable[[str], str | None]) -> None:
    """Raise :class:`ValidationFailed` naming the first reference that is not a distinct, stored inference record of
    ``scenario``; ``lookup`` gives the kind of the scenario's record with that id, or ``None``. Ids are scoped per
    scenario: another scenario's record of the same id is not there, as an unknown one is not."""
    if not isinstance(ids, (list, tuple)):
        raise ValidationFailed("references must be a list of record ids", field="references")
    seen: set[str] = set()
    for ref in ids:
        if not isinstance(ref, str) or not ref:
            raise ValidationFailed(f"reference {ref!r} is not a record id", field="references", reference=ref)
        if ref in seen:
            raise ValidationFailed(f"reference {ref!r} is listed twice", field="references", reference=ref)
        seen.add(ref)
        kind = lookup(ref)
        if kind is None:
            raise ValidationFailed(f"reference {ref!r} is not a stored record", field="references", reference=ref)
        if kind != "inference":
            raise ValidationFailed(f"reference {ref!r} is a {kind} record, not an inference record",
                                   field="references", reference=ref)


def _conflict(record: Record) -> Conflict:
    return Conflict(f"record id {record.record_id!r} was already used with different content",
                    record_id=record.record_id)


def _keyed_replay(prior: Record, record: Record, key: str) -> bool:
    """Whether an append of ``record`` under an idempotency key that already names ``prior`` returns ``prior``
    instead of storing ``record``.

    Only a complete record is an answer worth replaying: a retry of an incomplete one (a cut stream, a client that
    left) is stored, and the key moves on to it. A complete record is kept for good; an incomplete attempt that
    raced with it is stored beside it (what was generated is kept) and the key stays. A key reused for another
    request (a different request hash) is a :class:`Conflict`, as a reused record id is.
    """
    if prior.request_hash is not None and record.request_hash is not None and prior.request_hash != record.request_hash:
        raise Conflict(f"idempotency key {key!r} was already used for another request", idempotency_key=key,
                       record_id=prior.record_id)
    return prior.complete and record.complete


def apply_appends(conn: sa.Connection, dialect: str, batch: list[AppendRequest]) -> int:
    """Store the batch inside the caller's transaction; set each request's ``outcome``; return rows inserted.

    Raises only on database errors (the caller then rolls back and retries request by request).
    """
    wanted = {key_of(r) for req in batch for r in req.records}
    keyed: dict[str, set[str]] = {}  # scenario -> the idempotency keys the batch names in it
    for req in batch:
        if req.idempotency_key is not None:
            keyed.setdefault(req.records[0].scenario, set()).add(req.idempotency_key)
    stored_keys: dict[tuple[str, str], str] = {}
    for scenario, names in keyed.items():
        for chunk in _chunks(sorted(names)):
            for row in conn.execute(q.keys_by_key(dialect), {"scenario": scenario, "keys": list(chunk)}):
                stored_keys[(row.scenario, row.idempotency_key)] = row.record_id
    existing = fetch_records(conn, wanted | {(s, rid) for (s, _), rid in stored_keys.items()})

    refs = {(r.scenario, ref) for req in batch if req.check_references for r in req.records if r.kind == "report"
            for ref in r.references if isinstance(ref, str)}
    ref_kinds = fetch_ref_info(conn, refs - existing.keys() - wanted)

    new: dict[Key, Record] = {}  # staged for insertion, in arrival order
    encoded: dict[Key, tuple[str, str, str]] = {}
    new_keys: dict[tuple[str, str], str] = {}
    results: list[list[Key] | ReefError] = []

    def find(key: Key, staged: dict[Key, Record]) -> Record | None:
        return staged.get(key) or new.get(key) or existing.get(key)

    def ref_lookup(scenario: str, staged: dict[Key, Record]) -> Callable[[str], str | None]:
        # A report may quote inference records staged earlier in its own request or batch (same transaction).
        def lookup(ref: str) -> str | None:
            hit = find((scenario, ref), staged)
            return hit.kind if hit is not None else ref_kinds.get((scenario, ref))
        return lookup

    for req in batch:
        try:
            keep_key = False  # the key names a complete record: store this attempt beside it, key unchanged
            if req.idempotency_key is not None:
                slot = (req.records[0].scenario, req.idempotency_key)
                mapped = new_keys.get(slot) or stored_keys.get(slot)
                prior = find((slot[0], mapped), {}) if mapped is not None else None
                if prior is not None:
                    if _keyed_replay(prior, req.records[0], req.idempotency_key):
                        results.append([key_of(prior)])
                        continue
                    keep_key = prior.complete
            staged: dict[Key, Record] = {}
            keys: list[Key] = []
            for record in req.records:
                key = key_of(record)
                prior = find(key, staged)
                if prior is not None:
                    if prior.content_hash != record.content_hash:
                        raise _conflict(record)
                else:
                    if req.check_references and record.kind == "report":
                        validate_references(record.scenario, record.references, ref_lookup(record.scenario, staged))
                    encoded[key] = encode_json_columns(record)
                    staged[key] = record
                keys.append(key)
            new.update(staged)  # only once the whole request is accepted: all-or-nothing
            if req.idempotency_key is not None and not keep_key:
                new_keys[(req.records[0].scenario, req.idempotency_key)] = keys[0][1]
            results.append(keys)
        except ReefError as exc:
            results.append(exc)

    assigned = _write_staged(conn, dialect, batch, results, new, encoded, new_keys, stored_keys)
    for req, result in zip(batch, results):
        if isinstance(result, BaseException):
            req.outcome = result
        else:
            req.outcome = [
                new[key].with_sequence(assigned[key]) if key in new else existing[key] for key in result
            ]
    return len(new)


def _write_staged(conn: sa.Connection, dialect: str, batch: list[AppendRequest], results: list,
                  new: dict[Key, Record], encoded: dict[Key, tuple[str, str, str]],
                  new_keys: dict[tuple[str, str], str], stored_keys: dict[tuple[str, str], str]) -> dict[Key, int]:
    """Write what the batch staged: the scenarios its accepted requests create, the new records with their
    sequence numbers (returned), and the idempotency keys added or moved to a newer attempt."""
    fresh_scenarios = {req.records[0].scenario: req.new_scenario_recipe for req, result in zip(batch, results)
                       if req.new_scenario_recipe is not None and not isinstance(result, BaseException)}
    now = time.time()
    for name, recipe in fresh_scenarios.items():
        conn.execute(q.create_scenario(dialect), {"name": name, "recipe": recipe, "created_at": now, "archived": False})
    assigned = _assign_sequences(conn, dialect, list(new.values()))
    if new:
        rows = [record_to_params(r, assigned[key], encoded[key]) for key, r in new.items()]
        _insert_records(conn, rows)
    fresh_keys = [(slot, rid) for slot, rid in new_keys.items() if slot not in stored_keys]
    if fresh_keys:
        conn.execute(q.INSERT_KEY, [
            {"scenario": s, "idempotency_key": k, "record_id": rid, "created_at": now} for (s, k), rid in fresh_keys
        ])
    repointed = [(slot, rid) for slot, rid in new_keys.items() if stored_keys.get(slot, rid) != rid]
    if repointed:
        conn.execute(q.REPOINT_KEY, [
            {"key_scenario": s, "key_name": k, "new_record_id": rid} for (s, k), rid in repointed
        ])
    return assigned


def _assign_sequences(conn: sa.Connection, dialect: str, fresh: list[Record]) -> dict[Key, int]:
    """Reserve a contiguous block of sequence numbers per scenario and hand them out in arrival order."""
    per_scenario: dict[str, list[Record]] = {}
    for record in fresh:
        per_scenario.setdefault(record.scenario, []).append(record)
    assigned: dict[Key, int] = {}
    reserve = _driver_sql(conn).reserve_sequence if per_scenario else ""
    for scenario, group in per_scenario.items():
        count = len(group)
        last = int(_scalar(conn, reserve, (scenario, count)))
        for offset, record in enumerate(group):
            assigned[key_of(record)] = last - count + 1 + offset
    return assigned
