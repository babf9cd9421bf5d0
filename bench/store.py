"""Sustained durable record writes/s with concurrent appenders (group commit), SQLite and PostgreSQL.

Each appender is an asyncio task that builds an interaction record of about 2 KB (like one chat turn) and awaits
``RecordStore.append``, which returns only once the row is committed durably (SQLite WAL ``synchronous=FULL``;
PostgreSQL ``synchronous_commit=on``). A single-appender run shows the one-fsync-per-write floor the group
commit is there to lift; the concurrent runs (``--concurrency``, default 64 and 512 appenders) show what it lifts it
to. Every run ends by counting the stored rows. Beside each run, in the same table, the compared system
(:mod:`bench.store_raw`): raw ``executemany`` batches of the same rows with a durable commit each, as many rows per
transaction as that many appenders could hand one commit, printed as Reef / raw. The SQLite run also measures the
fsync latency of the store's directory (what each durable commit pays at least). ``--profile PATH`` writes a cProfile of each
backend's concurrent run, the event loop's thread and the writer thread apart, to ``PATH_<backend>_<appenders>.txt``.
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
    parser.add_argument("--concurrency", default="64,512",
                        help="concurrent appenders of the concurrent runs, comma-separated (default 64,512)")
    parser.add_argument("--single", type=int, default=300, help="records of the single-appender run (default 300)")
    parser.add_argument("--backends", default="sqlite,postgres", help="sqlite,postgres")
    parser.add_argument("--pg-url", default=PG_URL)
    parser.add_argument("--no-raw", action="store_true", help="skip the raw batched-insert contender")
    parser.add_argument("--profile", default=None,
                        help="write cProfiles of the concurrent runs to PATH_<backend>_<appenders>.txt (loop and writer threads)")


def _payload(i: int) -> dict:
    text = f"question {i}: " + "lorem ipsum dolor sit amet " * 30
    return {"route": "chat", "dialect": "openai", "client_dialect": "openai", "engine": "upstream:bench",
            "stream": False, "timings": {"engine_ms": 1.0, "total_ms": 1.5},
            "request": {"model": "fake-model", "messages": [{"role": "user", "content": text}]},
            "response": {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": "fake-model",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "echo: " + text}}],
                         "usage": {"prompt_tokens": 150, "completion_tokens": 151, "total_tokens": 301}}}


async def _append_all(store, scenario: str, count: int, concurrency: int) -> tuple[float, list[float], float]:
    """Wall seconds, each append's latency (ms) and the event loop thread's CPU seconds spent building the
    records (payload, ids, ``Record`` with its content hash), which the raw contender's row building matches."""
    from reef_core.observe.model import Record

    latencies: list[float] = []
    build_cpu = [0.0]
    next_index = iter(range(count))

    async def appender() -> None:
        for i in next_index:  # shared iterator: the tasks split the work between them
            began = time.thread_time()
            record = Record(record_id=uuid.uuid4().hex, scenario=scenario, kind="inference", payload=_payload(i),
                            tags={"bench": "store"}, request_hash=uuid.uuid4().hex)
            build_cpu[0] += time.thread_time() - began
            started = time.perf_counter()
            await store.append(record)
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(appender() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, build_cpu[0]


def _measure(store, backend: str, count: int, concurrency: int, profile: str | None = None) -> dict:
    scenario = f"bench-{concurrency}-{uuid.uuid4().hex[:8]}"
    before = store.stats
    profilers = _start_profiles(store) if profile else None
    cpu_before = time.process_time()  # this process: the appenders and the store's writer thread
    wall, latencies, build_cpu = asyncio.run(_append_all(store, scenario, count, concurrency))
    cpu = time.process_time() - cpu_before
    if profilers:
        _write_profiles(store, profilers, f"{profile}_{backend}_{concurrency}.txt",
                        f"{count} records, {concurrency} appenders, {backend}, wall {wall:.2f} s")
    after = store.stats
    stored = store.count(scenario)
    transactions = after.transactions - before.transactions
    return {"backend": backend, "concurrency": concurrency, "records": count, "stored": stored,
            "wall_s": round(wall, 3), "records_per_s": round(count / wall, 1),
            "cpu_ms_per_record": round(cpu * 1000 / count, 3),
            "build_cpu_ms_per_record": round(build_cpu * 1000 / count, 3),
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


def _backend_runs(store, backend: str, args, raw_target) -> tuple[list[dict], list[dict]]:
    """Reef's runs and the raw contender's, alternating: one appender beside raw single-row transactions, then per
    concurrency the store beside raw transactions of as many rows as that many appenders can hand one commit
    (at most the store's batch of 500)."""
    runs, raws = [], []
    plans = [(1, args.single, 1)] + [(c, args.records, min(c, 500)) for c in _concurrencies(args)]
    for concurrency, count, batch in plans:
        runs.append(_measure(store, backend, count, concurrency, args.profile if concurrency > 1 else None))
        if not args.no_raw:
            raw = raw_target(count, batch)
            raw.update(backend=backend, appenders=concurrency)
            raws.append(raw)
    return runs, raws


def _concurrencies(args) -> list[int]:
    return [int(c) for c in str(args.concurrency).split(",") if c.strip()]


def _open(backend: str, args, workdir: Path):
    """The store under test and a ``raw_target(records, batch)`` writing raw rows into its own table."""
    from bench import store_raw
    from reef_core.observe.records import RecordStore

    if backend == "sqlite":
        store = RecordStore.open(None, workdir)
        db = str(workdir / "records.db")
        return store, None, lambda count, batch: store_raw.sqlite_runs(db, _payload, [(count, batch)])[0]
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    store = RecordStore.open(args.pg_url, workdir, schema=schema)
    return store, schema, lambda count, batch: store_raw.postgres_runs(args.pg_url, schema, _payload,
                                                                       [(count, batch)])[0]


def run(args) -> dict:
    from bench import store_raw

    machine = common.machine()
    runs, raws, skipped, fsync = [], [], {}, {}
    for backend in args.backends.split(","):
        if backend not in ("sqlite", "postgres"):
            raise SystemExit(f"unknown backend {backend!r}")
        if backend == "postgres" and not _postgres_up(args.pg_url):
            skipped[backend] = f"PostgreSQL not reachable at {args.pg_url}"
            continue
        workdir = Path(tempfile.mkdtemp(prefix="reef-bench-store-"))
        schema = None
        try:
            if backend == "sqlite":
                fsync = store_raw.fsync_probe(str(workdir))
            store, schema, raw_target = _open(backend, args, workdir)
            try:
                backend_runs, backend_raws = _backend_runs(store, backend, args, raw_target)
                runs += backend_runs
                raws += backend_raws
            finally:
                store.close()
        finally:
            if schema is not None:
                _drop_schema(args.pg_url, schema)
            shutil.rmtree(workdir, ignore_errors=True)
    return _report(machine, runs, raws, skipped, fsync)


def _report(machine: dict, runs: list[dict], raws: list[dict], skipped: dict, fsync: dict) -> dict:
    raw_of = {(r["backend"], r["appenders"]): r for r in raws}
    rows = []
    for r in runs:
        raw = raw_of.get((r["backend"], r["concurrency"]))
        r["raw_ratio"] = round(r["records_per_s"] / raw["records_per_s"], 2) if raw else None
        rows.append([r["backend"], r["concurrency"], r["records"], r["stored"], r["records_per_s"],
                     r["append_ms"]["p50"], r["append_ms"]["p99"], r["cpu_ms_per_record"],
                     r["build_cpu_ms_per_record"], r["rows_per_transaction"],
                     r["largest_batch"], raw["batch"] if raw else "-", raw["records_per_s"] if raw else "-",
                     f"x{r['raw_ratio']:.2f}" if raw else "-"])
    print(common.table(["backend", "appenders", "records", "stored", "records/s", "p50 ms", "p99 ms",
                        "cpu ms/record", "of it building", "rows/txn", "largest batch", "raw rows/txn", "raw records/s",
                        "Reef/raw"], rows))
    if raws:
        print("\nraw batched inserts (same table, executemany + durable commit per batch):")
        print(common.table(["backend", "rows/txn", "records", "records/s", "commit p50 ms", "commit p99 ms",
                            "cpu ms/record"],
                           [[r["backend"], r["batch"], r["records"], r["records_per_s"], r["commit_ms"]["p50"],
                             r["commit_ms"]["p99"], r["cpu_ms_per_record"]] for r in raws]))
    if fsync:
        print(f"fsync of a 4 KiB write in the SQLite store's directory: p50 {fsync['p50']} ms, p99 {fsync['p99']} ms "
              f"({fsync['n']} samples)")
    load_end = round(os.getloadavg()[0], 2)
    print(f"1-minute load: {machine['load_avg_1m_at_start']} at start, {load_end} at end")
    for backend, why in skipped.items():
        print(f"skipped {backend}: {why}")
    problems = [f"{r['backend']} c={r['concurrency']}: stored {r['stored']} of {r['records']}"
                for r in runs if r["stored"] != r["records"]]
    for problem in problems:
        print("PROBLEM:", problem)
    best = {}
    for r in runs:
        if r["concurrency"] > 1:
            best[r["backend"]] = max(best.get(r["backend"], 0), r["records_per_s"])
    targets = {"sqlite_15000_per_s": ("sqlite", 15000), "postgres_10000_per_s": ("postgres", 10000)}  # issue #41
    return {"machine": machine, "load_avg_1m_at_end": load_end, "runs": runs, "raw": raws, "fsync_ms": fsync,
            "skipped": skipped, "problems": problems,
            "targets_met": {name: best[backend] >= floor if backend in best else None
                            for name, (backend, floor) in targets.items()}}


def _drop_schema(url: str, schema: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        engine.dispose()
