"""Profile the one-client proxy path of `reef serve` (``python -m bench.latency_profile``).

Starts the fake upstream and ``reef serve`` (upstream engine, durable SQLite records) under
``python -m cProfile``, sends warm-up and then ``--requests`` sequential chat completions over one kept-alive
connection (the client of ``python -m bench proxy``), stops the server with SIGINT so the profile is written, and
writes a text summary: the top functions by own time, Reef's and the HTTP client's by cumulative time, and who
submits work to thread pools (a thread hop per request costs a wake-up on a busy machine). cProfile sees the main
thread only: the event loop, not the record writer thread.

    nice -n 19 python -m bench.latency_profile --requests 2000 --out bench/profiles/latency_after.txt
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import shutil
import signal
import tempfile
import time
from pathlib import Path

from bench import common
from bench.proxy import Client

_PREFIXES = ("/work/main/.venv/lib/python3.11/site-packages/", str(Path(os.__file__).parent) + "/",
             str(Path(__file__).resolve().parent.parent) + "/")


def profile(requests: int, warmup: int) -> tuple[str, float]:
    work = Path(tempfile.mkdtemp(prefix="reef-latency-profile-"))
    stub = common.start_stub(work)
    try:
        port = common.free_port()
        stats_path = work / "reef.pstats"
        cmd = [common.PYTHON, "-m", "cProfile", "-o", str(stats_path), "-m", "reef_core.cli", "serve",
               "engine.kind=upstream", f"engine.upstream_url={stub.url}", f"server.port={port}",
               f"storage.data_dir={work / 'data'}", "server.log_level=warning"]
        reef = common.Child("reef", cmd, f"http://127.0.0.1:{port}", work / "reef.log",
                            env={"REEF_TOKEN": common.TOKEN},
                            unset=("REEF_ADMIN_TOKEN", "REEF_UPSTREAM_API_KEY", "REEF_UPSTREAM_MODEL")).start()
        client = Client(reef.url)
        try:
            for _ in range(warmup):
                client.call()
            began = time.perf_counter()
            for _ in range(requests):
                client.call()
            mean_ms = (time.perf_counter() - began) * 1000 / requests
        finally:
            client.close()
        os.killpg(reef.pid, signal.SIGINT)  # uvicorn shuts down; cProfile writes its file as the process exits
        reef.proc.wait(60)
        buf = io.StringIO()
        stats = pstats.Stats(str(stats_path), stream=buf)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(r"reef_core|aiohttp/client.py|thread.py|threads.py", 30)
        stats.print_callers(r"thread.py:161")
        text = buf.getvalue()
        for prefix in _PREFIXES:
            text = text.replace(prefix, "")
        return text, mean_ms
    finally:
        stub.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    text, mean_ms = profile(args.requests, args.warmup)
    head = (f"# One-client proxy path under cProfile (python -m bench.latency_profile): {args.warmup} warm-up + "
            f"{args.requests} sequential\n# POST /v1/chat/completions, mean {mean_ms:.2f} ms per call under the "
            f"profiler, 1-minute load {load:.2f} at start.\n# Main thread only (event loop); start-up rows "
            f"(imports, compile) included; per-request rows have ncalls ~{args.requests + args.warmup} or a "
            f"multiple.\n")
    args.out.write_text(head + text)
    print(f"wrote {args.out} (mean {mean_ms:.2f} ms per call under the profiler, load {load:.2f})")


if __name__ == "__main__":
    main()
