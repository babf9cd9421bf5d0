"""Sustained durable record writes/s with concurrent appenders (group commit), SQLite and PostgreSQL.

Each appender is an asyncio task that builds an interaction record of about 2 KB (like one chat turn) and awaits
``RecordStore.append``, which returns only once the row is committed durably (SQLite WAL ``synchronous=FULL``;
PostgreSQL ``synchronous_commit=on``). A single-appender run shows the one-fsync-per-write floor the group
commit is there to lift. Every run ends by counting the stored rows. ``--profile PATH`` writes a cProfile of each
backend's concurrent run, the event loop's thread and the writer thread apart, to ``PATH_<backend>.txt``.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

from bench import common

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def add_arguments(parser) -> None:
    parser.add_argument("--records", type=int, default=20_000, help="records per concurrent run (default 20k)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent appenders (default 64)")
    parser.add_argument("--single", type=int, default=300, help="records of the single-appender run (default 300)")
    parser.add_argument("--backends", default="sqlite,postgres", help="sqlite,postgres")
    parser.add_argument("--pg-url", default=PG_URL)
    parser.add_argument("--profile", default=None,
                        help="write cProfiles of the concurrent runs to PATH_<backend>.txt (loop and writer threads)")


def _payload(i: int) -> dict:
    text = f"question {i}: " + "lorem ipsum dolor sit amet " * 30
    return {"route": "chat", "dialect": "openai", "client_dialect": "openai", "engine": "upstream:bench",
            "stream": False, "timings": {"engine_ms": 1.0, "total_ms": 1.5},
            "request": {"model": "fake-model", "messages": [{"role": "user", "content": text}]},
            "response": {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": "fake-model",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "echo: " + text}}],
                         "usage": {"prompt_tokens": 150, "completion_tokens": 151, "total_tokens": 301}}}


async def _append_all(store, scenario: str, count: int, concurrency: int) -> tuple[float, list[float]]:
    from reef_core.observe.model import Record

    latencies: list[float] = []
    next_index = iter(range(count))

    async def appender() -> None:
        for i in next_index:  # shared iterator: the tasks split the work between them
            record = Record(record_id=uuid.uuid4().hex, scenario=scenario, kind="inference", payload=_payload(i),
                            tags={"bench": "store"}, request_hash=uuid.uuid4().hex)
            started = time.perf_counter()
            await store.append(record)
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(appender() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


def _measure(store, backend: str, count: int, concurrency: int, profile: str | None = None) -> dict:
    scenario = f"bench-{concurrency}-{uuid.uuid4().hex[:8]}"
    before = store.stats
    profilers = _start_profiles(store) if profile else None
    cpu_before = time.process_time()  # this process: the appenders and the store's writer thread
    wall, latencies = asyncio.run(_append_all(store, scenario, count, concurrency))
    cpu = time.process_time() - cpu_before
    if profilers:
        _write_profiles(store, profilers, f"{profile}_{backend}.txt",
                        f"{count} records, {concurrency} appenders, {backend}, wall {wall:.2f} s")
    after = store.stats
    stored = store.count(scenario)
    transactions = after.transactions - before.transactions
    return {"backend": backend, "concurrency": concurrency, "records": count, "stored": stored,
            "wall_s": round(wall, 3), "records_per_s": round(count / wall, 1),
            "cpu_ms_per_record": round(cpu * 1000 / count, 3),
            "append_ms": common.percentiles(latencies), "transactions": transactions,
            "rows_per_transaction": round(count / transactions, 1) if transactions else None,
            "largest_batch": after.largest_batch}


def _start_profiles(store) -> tuple[cProfile.Profile, cProfile.Profile]:
    """Profile this thread and the store's writer thread (a profiler covers the thread that enables it, so the
    writer's is switched on by a call run on that thread)."""
    loop_profile, writer_profile = cProfile.Profile(), cProfile.Profile()
    store._writer.submit_call(lambda _conn: writer_profile.enable()).result()
    loop_profile.enable()
    return loop_profile, writer_profile


def _write_profiles(store, profilers: tuple[cProfile.Profile, cProfile.Profile], path: str, title: str) -> None:
    loop_profile, writer_profile = profilers
    loop_profile.disable()
    store._writer.submit_call(lambda _conn: writer_profile.disable()).result()
    text = io.StringIO()
    text.write(f"{title}; load {os.getloadavg()[0]:.2f}\n")
    for name, profiler in (("event loop thread (appenders)", loop_profile), ("writer thread", writer_profile)):
        text.write(f"\n== {name}, by own time ==\n")
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text.getvalue())
    print(f"profile: {path}")


def _postgres_up(url: str) -> bool:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    try:
        with socket.create_connection((parsed.host or "127.0.0.1", parsed.port or 5432), timeout=1):
            return True
    except OSError:
        return False


def run(args) -> dict:
    from reef_core.observe.records import RecordStore

    machine = common.machine()
    runs, skipped = [], {}
    for backend in args.backends.split(","):
        workdir = Path(tempfile.mkdtemp(prefix="reef-bench-store-"))
        schema = None
        try:
            if backend == "sqlite":
                store = RecordStore.open(None, workdir)
            elif backend == "postgres":
                if not _postgres_up(args.pg_url):
                    skipped[backend] = f"PostgreSQL not reachable at {args.pg_url}"
                    continue
                schema = f"bench_{uuid.uuid4().hex[:12]}"
                store = RecordStore.open(args.pg_url, workdir, schema=schema)
            else:
                raise SystemExit(f"unknown backend {backend!r}")
            try:
                runs.append(_measure(store, backend, args.single, 1))
                runs.append(_measure(store, backend, args.records, args.concurrency, args.profile))
            finally:
                store.close()
        finally:
            if schema is not None:
                _drop_schema(args.pg_url, schema)
            shutil.rmtree(workdir, ignore_errors=True)

    rows = [[r["backend"], r["concurrency"], r["records"], r["stored"], r["records_per_s"], r["append_ms"]["p50"],
             r["append_ms"]["p99"], r["cpu_ms_per_record"], r["rows_per_transaction"], r["largest_batch"]]
            for r in runs]
    print(common.table(["backend", "appenders", "records", "stored", "records/s", "p50 ms", "p99 ms",
                        "cpu ms/record", "rows/txn", "largest batch"], rows))
    load_end = round(os.getloadavg()[0], 2)
    print(f"1-minute load: {machine['load_avg_1m_at_start']} at start, {load_end} at end")
    for backend, why in skipped.items():
        print(f"skipped {backend}: {why}")
    problems = [f"{r['backend']} c={r['concurrency']}: stored {r['stored']} of {r['records']}"
                for r in runs if r["stored"] != r["records"]]
    for problem in problems:
        print("PROBLEM:", problem)
    bulk = {r["backend"]: r["records_per_s"] for r in runs if r["concurrency"] > 1}
    targets = {"sqlite_5000_per_s": ("sqlite", 5000), "postgres_3000_per_s": ("postgres", 3000)}  # issue #23
    return {"machine": machine, "load_avg_1m_at_end": load_end, "runs": runs, "skipped": skipped,
            "problems": problems,
            "targets_met": {name: bulk[backend] >= floor if backend in bulk else None
                            for name, (backend, floor) in targets.items()}}


def _drop_schema(url: str, schema: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        engine.dispose()
