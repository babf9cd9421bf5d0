"""The compared system of ``python -m bench store``: raw batched inserts of the same rows into the same table.

The table is the record store's own (a store opened and closed first, so its migrations built the same columns
and indexes); the rows are the bench's records as the store keeps them: two uuid4 ids, the payload as compact JSON
(orjson), a sha256 of that text as the content hash, a sequence from a counter. One thread builds each batch,
inserts it with the driver's ``executemany`` (SQLite's C loop over one prepared statement; psycopg 3's pipeline
mode) and commits it with the store's durability: SQLite WAL ``synchronous=FULL``, PostgreSQL
``synchronous_commit=on``. There is no deduplication, validation, queueing or caller hand-off: what is left is the
database's own cost and one fsync per batch. A batch of 1 is the per-request floor (a commit and its fsync per row).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
import uuid

import orjson

from bench import common

_COLUMNS = ("record_id", "scenario", "kind", "sequence", "created_at", "version", "complete", "request_hash",
            "content_hash", "references", "tags", "payload", "top_k")


def _rows(payload, scenario: str, first: int, count: int, sequence: int) -> list[tuple]:
    rows = []
    for i in range(first, first + count):
        text = orjson.dumps(payload(i)).decode()
        sequence += 1
        rows.append((uuid.uuid4().hex, scenario, "inference", sequence, time.time(), None, True, uuid.uuid4().hex,
                     hashlib.sha256(text.encode()).hexdigest(), "[]", '{"bench":"store"}', text, None))
    return rows


def _insert_sql(table: str, mark: str) -> str:
    columns = ", ".join(f'"{c}"' for c in _COLUMNS)
    return f"INSERT INTO {table} ({columns}) VALUES ({', '.join([mark] * len(_COLUMNS))})"


def _run_batches(payload, count: int, batch: int, write) -> dict:
    """Build and write ``count`` rows in transactions of ``batch`` rows; ``write(rows)`` inserts and commits."""
    scenario = f"raw-{batch}-{uuid.uuid4().hex[:8]}"
    commits: list[float] = []
    cpu_before = time.process_time()
    started = time.perf_counter()
    for first in range(0, count, batch):
        rows = _rows(payload, scenario, first, min(batch, count - first), first)
        began = time.perf_counter()
        write(rows)
        commits.append((time.perf_counter() - began) * 1000)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    return {"batch": batch, "records": count, "wall_s": round(wall, 3), "records_per_s": round(count / wall, 1),
            "cpu_ms_per_record": round(cpu * 1000 / count, 3), "commit_ms": common.percentiles(commits)}


def sqlite_runs(db_path: str, payload, plan: list[tuple[int, int]]) -> list[dict]:
    """``plan``: (records, rows per transaction) pairs, run in order on the store file at ``db_path``."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
            raise RuntimeError("SQLite refused WAL")
        conn.execute("PRAGMA synchronous=FULL")
        sql = _insert_sql('"records"', "?")

        def write(rows: list[tuple]) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(sql, rows)
            conn.execute("COMMIT")

        return [_run_batches(payload, count, batch, write) for count, batch in plan]
    finally:
        conn.close()


def postgres_runs(url: str, schema: str, payload, plan: list[tuple[int, int]]) -> list[dict]:
    import psycopg
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    conn = psycopg.connect(host=parsed.host or "127.0.0.1", port=parsed.port or 5432, user=parsed.username,
                           password=parsed.password, dbname=parsed.database,
                           options="-c synchronous_commit=on")
    try:
        sql = _insert_sql(f'"{schema}"."records"', "%s")

        def write(rows: list[tuple]) -> None:
            with conn.cursor() as cursor:
                cursor.executemany(sql, rows)
            conn.commit()

        return [_run_batches(payload, count, batch, write) for count, batch in plan]
    finally:
        conn.close()


def fsync_probe(directory: str, count: int = 200) -> dict:
    """Latency of one 4 KiB write + ``fsync`` in ``directory``: what each durable SQLite commit pays at least."""
    path = os.path.join(directory, "fsync-probe.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    samples = []
    try:
        block = b"x" * 4096
        for i in range(count):
            os.pwrite(fd, block, (i % 64) * 4096)
            began = time.perf_counter()
            os.fsync(fd)
            samples.append((time.perf_counter() - began) * 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    return common.percentiles(samples)
