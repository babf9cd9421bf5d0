"""Requests/s at 1, 16 and 64 connections with ``wrk``: the stub alone, through Reef, through LiteLLM.

For Reef every run uses a scenario of its own; afterwards the store is read directly and compared with what wrk
saw: every receipt a client received must be a stored record, and records = receipts up to the requests wrk
abandoned in flight when its clock ran out (at most one per connection; those are stored but their answer is
never read).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import tempfile
import uuid
from pathlib import Path

from bench import common

LUA = Path(__file__).with_name("wrk") / "chat.lua"
CONNECTIONS = (1, 16, 64)


def add_arguments(parser) -> None:
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per wrk run (default 6)")
    parser.add_argument("--connections", default=",".join(map(str, CONNECTIONS)), help="e.g. 1,16,64")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    add_workers_argument(parser)


def add_workers_argument(parser) -> None:
    parser.add_argument("--workers", type=int, default=2,
                        help="also measure Reef with server.workers=N (target reef-wN; default 2; 1: skip)")


def start_workers_target(targets: dict, data_dirs: dict, workdir: Path, workers: int) -> common.Child | None:
    """Reef with ``server.workers=N`` beside the one-process Reef (its own data directory), once its workers
    listen: the primary's children, counted in its CPU time (process tree)."""
    if workers <= 1:
        return None
    name = f"reef-w{workers}"
    data_dirs[name] = workdir / f"data-w{workers}"
    child = common.start_reef(targets["stub"].url, data_dirs[name], f"server.workers={workers}", name=name)
    try:
        common.wait_for_workers(child, workers - 1)
    except BaseException:
        child.stop()
        raise
    targets[name] = child
    return child


def workers_ratio(rows: list[dict], connections: int = 64) -> tuple[str, float] | None:
    """(target, its req/s over one-process Reef's) at ``connections``, for the reef-wN target."""
    by_target = {r["target"]: r for r in rows if r["connections"] == connections}
    one = by_target.get("reef")
    for name, row in by_target.items():
        if name.startswith("reef-w") and one and one["rps"]:
            return name, round(row["rps"] / one["rps"], 2)
    return None


def stub_share(rows: list[dict], connections: int = 64, target: str = "reef") -> float:
    """``target``'s req/s over the direct stub's at ``connections``, both measured in the same run (issue #41's
    throughput row: >= 0.5 with the default config); 0.0 when either is missing."""
    by_target = {r["target"]: r for r in rows if r["connections"] == connections}
    stub, proxied = by_target.get("stub"), by_target.get(target)
    if not stub or not proxied or not stub["rps"]:
        return 0.0
    return round(proxied["rps"] / stub["rps"], 3)


def print_ratios(rows: list[dict]) -> None:
    """The ratios at 64 connections: each proxy over the stub, and the workers over one process."""
    shares = {r["target"]: stub_share(rows, 64, r["target"]) for r in rows if r["connections"] == 64
              and r["target"] != "stub"}
    if shares:
        print("req/s over the stub's at 64 connections: " + ", ".join(f"{k} x{v}" for k, v in shares.items()))
    ratio = workers_ratio(rows)
    if ratio:
        print(f"{ratio[0]} / reef (one process) at 64 connections: x{ratio[1]} req/s")


def wrk(url: str, connections: int, duration: float, scenario: str, receipts_dir: Path | None = None) -> dict:
    """One wrk run against ``url``; returns wrk's counters plus requests/s (and receipt ids when asked)."""
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian package `wrk`)")
    env = {**os.environ, "BENCH_SCENARIO": scenario, "BENCH_BODY": common.chat_body().decode(),
           "BENCH_TOKEN": common.TOKEN}
    if receipts_dir is not None:
        env["BENCH_RECEIPTS_DIR"] = str(receipts_dir)
    # One wrk thread: on a 2-core box every extra client thread steals CPU from the servers under test.
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s",
           "-s", str(LUA), url + "/v1/chat/completions"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=duration + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    result = json.loads(line[len("WRK_JSON "):])
    result["connections"] = connections
    result["rps"] = round(result["requests"] / (result["duration_us"] / 1e6), 1)
    result["ok_rps"] = round(result["ok"] / (result["duration_us"] / 1e6), 1)
    result["latency_ms"] = {k: round(v / 1000, 3) for k, v in result.pop("latency_us").items()}
    return result


def stored_ids(data_dir: Path, scenario: str) -> set[str]:
    """Record ids of ``scenario`` in Reef's SQLite store, read directly (read-only; the server keeps running)."""
    db = sqlite3.connect(f"file:{data_dir / 'records.db'}?mode=ro", uri=True)
    try:
        return {row[0] for row in db.execute("SELECT record_id FROM records WHERE scenario = ?", (scenario,))}
    finally:
        db.close()


def read_receipts(receipts_dir: Path) -> list[str]:
    ids: list[str] = []
    for path in sorted(receipts_dir.glob("*.txt")):
        ids.extend(line.strip() for line in path.read_text().splitlines() if line.strip())
    return ids


def measure(targets: dict[str, common.Child], data_dirs: dict[str, Path], connections: list[int],
            duration: float) -> list[dict]:
    """wrk each target at each concurrency (targets interleaved per concurrency); Reef runs (the targets named in
    ``data_dirs``, each with its data directory) get the store check.

    Each row also carries the server's CPU time per request (process tree, all threads): unlike requests/s, it
    hardly depends on what else the machine is running."""
    rows = []
    for conns in connections:
        for name, child in targets.items():
            url = child.url
            scenario = f"bench-{name}-c{conns}-{uuid.uuid4().hex[:8]}"
            wrk(url, max(conns, 4), 1, f"warmup-{scenario}")  # connections, pools and the scenario row
            cpu_before = child.cpu_seconds()
            if name in data_dirs:
                with tempfile.TemporaryDirectory() as tmp:
                    result = wrk(url, conns, duration, scenario, Path(tmp))
                    receipts = read_receipts(Path(tmp))
                stored = stored_ids(data_dirs[name], scenario)
                missing = [r for r in receipts if r not in stored]
                result.update({
                    "records_stored": len(stored),
                    "receipt_ids_logged": len(receipts),
                    "receipts_missing_from_store": len(missing),
                    "duplicate_receipts": len(receipts) - len(set(receipts)),
                    # Requests wrk sent but never read the answer of: stored, never receipted.
                    "records_without_receipt": len(stored - set(receipts)),
                })
            else:
                result = wrk(url, conns, duration, scenario)
            cpu = child.cpu_seconds() - cpu_before
            result["server_cpu_ms_per_request"] = round(cpu * 1000 / result["requests"], 3) if result["requests"] else None
            result["target"] = name
            rows.append(result)
    return rows


def check(rows: list[dict]) -> list[str]:
    """Problems with the Reef rows: a receipt without a record, a record beyond abandoned requests, a non-200."""
    problems = []
    for row in rows:
        if "records_stored" not in row:  # not a Reef run
            continue
        c = f"{row['target']} c={row['connections']}"
        if row["receipts_missing_from_store"]:
            problems.append(f"{c}: {row['receipts_missing_from_store']} receipts are not in the store")
        if row["receipts"] != row["receipt_ids_logged"] or row["duplicate_receipts"]:
            problems.append(f"{c}: receipts counted {row['receipts']} vs logged {row['receipt_ids_logged']} "
                            f"({row['duplicate_receipts']} duplicates)")
        if row["records_without_receipt"] > row["connections"]:
            problems.append(f"{c}: {row['records_without_receipt']} records have no receipt (> {row['connections']} in flight)")
        if row["bad"] or sum(row["errors"].values()):
            problems.append(f"{c}: {row['bad']} non-200 answers, errors {row['errors']}")
    return problems


def table_rows(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        out.append([r["target"], r["connections"], r["rps"], r["latency_ms"]["p50"], r["latency_ms"]["p99"],
                    r.get("server_cpu_ms_per_request"), r["ok"], r["bad"] + sum(r["errors"].values()),
                    r.get("receipts"), r.get("records_stored")])
    return out


HEADERS = ["target", "conns", "req/s", "p50 ms", "p99 ms", "cpu ms/req", "ok", "errors", "receipts", "records"]


def run(args) -> dict:
    machine = common.machine()  # the load average before we add ours
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    children = []
    try:
        started, targets = common.start_systems(workdir, not args.no_litellm)
        children.extend(started)
        data_dirs = {"reef": workdir / "data"}
        extra = start_workers_target(targets, data_dirs, workdir, args.workers)
        if extra is not None:
            children.append(extra)
        connections = [int(c) for c in str(args.connections).split(",")]
        rows = measure(targets, data_dirs, connections, args.duration)
        rss = {c.name: c.peak_rss_mib() for c in children}
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    problems = check(rows)
    print(common.table(HEADERS, table_rows(rows)))
    print_ratios(rows)
    for problem in problems:
        print("PROBLEM:", problem)
    return {"machine": machine, "duration_s": args.duration, "runs": rows,
            "peak_rss_mib": rss, "problems": problems}
