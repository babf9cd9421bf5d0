"""Requests/s through 1 and 2 PostgreSQL-backed ``reef serve`` replicas at 64 connections (records = receipts).

Two replicas (``server.learner=false``) share one PostgreSQL schema and one bare git repository, in front of the
stub. Each round runs ``wrk`` at 64 connections once against replica A alone and once split 32 + 32 over A and B
(two wrk processes at once), in alternating order; both replicas run throughout, so the only difference is where
the load goes. Every receipt a client received must be a stored record of that run's scenario (PostgreSQL read
directly) and records can exceed receipts only by requests abandoned in flight (at most one per connection).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

from bench import common
from bench.throughput import read_receipts, wrk

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def add_arguments(parser) -> None:
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run (default 8)")
    parser.add_argument("--connections", type=int, default=64, help="connections in all (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (1 replica, 2 replicas) (default 3)")
    parser.add_argument("--pg-url", default=PG_URL)


def _stored_ids(engine, scenario: str) -> set[str]:
    """Record ids of ``scenario``, read from the replicas' schema (``engine`` maps the tables to it)."""
    import sqlalchemy as sa

    from reef_core.observe.schema import records

    with engine.connect() as conn:
        rows = conn.execute(sa.select(records.c.record_id).where(records.c.scenario == scenario))
        return {row[0] for row in rows}


def _run(replicas: list[common.Child], connections: int, duration: float, engine) -> dict:
    """One measurement: ``connections`` split evenly over ``replicas``, one wrk process each, run at once."""
    scenario = f"bench-r{len(replicas)}-{uuid.uuid4().hex[:8]}"
    per = connections // len(replicas)
    for child in replicas:
        wrk(child.url, 4, 1, f"warmup-{scenario}")
    results: list[dict] = [{} for _ in replicas]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / str(i) for i in range(len(replicas))]
        for d in dirs:
            d.mkdir()

        def one(i: int) -> None:
            results[i] = wrk(replicas[i].url, per, duration, scenario, dirs[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        receipts = [r for d in dirs for r in read_receipts(d)]
    stored = _stored_ids(engine, scenario)
    seconds = max(r["duration_us"] for r in results) / 1e6
    return {
        "replicas": len(replicas), "connections": per * len(replicas),
        "requests": sum(r["requests"] for r in results), "ok": sum(r["ok"] for r in results),
        "bad": sum(r["bad"] + sum(r["errors"].values()) for r in results),
        "rps": round(sum(r["requests"] for r in results) / seconds, 1),
        "p50_ms": max(r["latency_ms"]["p50"] for r in results),
        "p99_ms": max(r["latency_ms"]["p99"] for r in results),
        "receipts": sum(r["receipts"] for r in results), "receipt_ids_logged": len(receipts),
        "duplicate_receipts": len(receipts) - len(set(receipts)),
        "records_stored": len(stored),
        "receipts_missing_from_store": sum(1 for r in receipts if r not in stored),
        "records_without_receipt": len(stored - set(receipts)),
    }


def _problems(row: dict) -> list[str]:
    tag = f"{row['replicas']} replica(s)"
    out = []
    if row["receipts_missing_from_store"]:
        out.append(f"{tag}: {row['receipts_missing_from_store']} receipts are not in the store")
    if row["duplicate_receipts"] or row["receipts"] != row["receipt_ids_logged"]:
        out.append(f"{tag}: receipts {row['receipts']} vs logged {row['receipt_ids_logged']} "
                   f"({row['duplicate_receipts']} duplicates)")
    if row["records_without_receipt"] > row["connections"]:
        out.append(f"{tag}: {row['records_without_receipt']} records without a receipt (> connections in flight)")
    if row["bad"]:
        out.append(f"{tag}: {row['bad']} non-200 answers or socket errors")
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def run(args) -> dict:
    import sqlalchemy as sa

    machine = common.machine()
    machine["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    raw = sa.create_engine(args.pg_url)
    with raw.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    engine = raw.execution_options(schema_translate_map={None: schema})
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-replicas-"))
    remote = workdir / "remote.git"
    subprocess.run(["git", "init", "--bare", "-q", str(remote)], check=True)
    children: list[common.Child] = []
    rows: list[dict] = []
    try:
        stub = common.start_stub(workdir)
        children.append(stub)
        shared = [f"storage.records_url={args.pg_url}", f"storage.records_schema={schema}",
                  f"storage.artifact_repository=file://{remote}", "server.learner=false"]
        for name in ("a", "b"):
            (workdir / name).mkdir()
            child = common.start_reef(stub.url, workdir / name / "data", *shared)
            child.name = f"reef-{name}"
            children.append(child)
        a, b = children[1], children[2]
        for i in range(args.rounds):
            order = ([a], [a, b]) if i % 2 == 0 else ([a, b], [a])
            for replicas in order:
                rows.append(_run(replicas, args.connections, args.duration, engine))
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        with raw.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        raw.dispose()
    problems = [p for row in rows for p in _problems(row)]
    one = [r["rps"] for r in rows if r["replicas"] == 1]
    two = [r["rps"] for r in rows if r["replicas"] == 2]
    ratio = round(_median(two) / _median(one), 2) if one and two else None
    headers = ["replicas", "conns", "req/s", "p50 ms", "p99 ms", "ok", "errors", "receipts", "records"]
    print(common.table(headers, [[r["replicas"], r["connections"], r["rps"], r["p50_ms"], r["p99_ms"], r["ok"],
                                  r["bad"], r["receipts"], r["records_stored"]] for r in rows]))
    print(f"\nmedian req/s: 1 replica {_median(one):,.1f}, 2 replicas {_median(two):,.1f}; ratio 2 vs 1: {ratio}")
    print(f"machine: {machine['uptime']}")
    for problem in problems:
        print("PROBLEM:", problem)
    return {"machine": machine, "duration_s": args.duration, "runs": rows, "median_rps_1": _median(one),
            "median_rps_2": _median(two), "ratio_2_vs_1": ratio, "problems": problems}
