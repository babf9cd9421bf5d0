"""Profile `reef serve` start-up and its first request, every thread included (``python -m bench.ready_profile``).

Runs ``reef_core.cli.main(["serve", ...])`` in this process under cProfile, one profiler per thread (the engine
loads its model on a worker thread, which a plain ``python -m cProfile`` does not see), while a client thread waits
for ``/healthz``, sends the first chat completion (1 token) and a second one, then stops the server with SIGINT.
Writes a text summary: the timeline, the slowest functions by cumulative time (all threads merged) and, with
``--importtime``, the slowest top-level imports of a second start under ``python -X importtime``.

    python -m bench.ready_profile --cache /work/cache --out bench/profiles/ready_after.txt --importtime
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench import common
from bench.ready import PROMPT, SCENARIO, serve_command


INTERESTING = r"(reef_core|reef_sao|transformers|safetensors|tokenizers|torch/nn|fastapi|hydra|sqlalchemy|alembic)/"


def _profile_threads(profiles: list[cProfile.Profile]) -> None:
    """Every thread started from now on runs under its own profiler (kept in ``profiles``)."""
    run = threading.Thread.run

    def profiled_run(self):
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    threading.Thread.run = profiled_run


def _post(url: str, max_tokens: int) -> float:
    body = json.dumps({"model": "reef", "messages": PROMPT, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json",
                                                                       "x-reef-scenario": SCENARIO})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()
    return time.perf_counter() - t


def _client(url: str, started: float, timeline: list[str]) -> None:
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            time.sleep(0.01)
    timeline.append(f"ready (/healthz 200)      {time.perf_counter() - started:7.2f} s after start")
    timeline.append(f"first request (1 token)   {_post(url, 1):7.3f} s")
    timeline.append(f"next request (16 tokens)  {_post(url, 16):7.3f} s")
    os.kill(os.getpid(), signal.SIGINT)  # uvicorn shuts down gracefully; cli.main returns


def _importtime(cmd: list[str], env: dict, url: str, top: int) -> str:
    """The slowest top-level imports of one start under ``-X importtime`` (stopped once ready)."""
    proc = subprocess.Popen([cmd[0], "-X", "importtime", *cmd[1:]], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                break
        except OSError:
            time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    rows = []
    for line in lines:
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\S.*)$", line.rstrip("\n"))
        if m:  # no leading spaces in the name: imported by the program itself, not by another module
            rows.append((int(m.group(2)), m.group(3)))
    rows.sort(reverse=True)
    total = sum(us for us, _ in rows)
    out = [f"top-level imports, cumulative (all {len(rows)}: {total / 1e6:.2f} s under -X importtime)"]
    out += [f"  {us / 1e6:7.2f} s  {name}" for us, name in rows[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ready_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=os.environ.get("REEF_MODEL_CACHE"), help="model cache (REEF_MODEL_CACHE)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", required=True, help="summary text file")
    parser.add_argument("--top", type=int, default=45, help="functions listed (default 45)")
    parser.add_argument("--importtime", action="store_true", help="also a start under python -X importtime")
    parser.add_argument("--raw", default=None, help="also write the merged cProfile stats there (pstats format)")
    args = parser.parse_args(argv)
    if not args.cache:
        parser.error("--cache (or REEF_MODEL_CACHE) is needed: the conversion is not part of start-up")
    os.environ["REEF_MODEL_CACHE"] = args.cache
    for var in ("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL"):
        os.environ.pop(var, None)
    workdir = Path(tempfile.mkdtemp(prefix="reef-ready-profile-"))
    sections = [f"machine: {json.dumps(common.machine())}"]

    port = common.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_command(port, workdir / "data", args.model, [])
    timeline: list[str] = []
    profiles: list[cProfile.Profile] = []
    _profile_threads(profiles)
    started = time.perf_counter()
    main_prof = cProfile.Profile()
    main_prof.enable()
    from reef_core.cli import main as reef_main  # imports are part of start-up

    threading.Thread(target=_client, args=(url, started, timeline), daemon=True).start()
    code = reef_main(cmd[3:])  # after "python -m reef_core.cli"
    main_prof.disable()
    timeline.append(f"server stopped (code {code}) {time.perf_counter() - started:5.2f} s after start")
    sections.append("timeline (under cProfile: slower than unprofiled)\n" + "\n".join("  " + t for t in timeline))

    stats = pstats.Stats(main_prof)
    for prof in profiles:
        try:
            stats.add(prof)
        except (TypeError, ValueError):  # a thread still running when we got here has no stats to add
            pass
    if args.raw:
        stats.dump_stats(args.raw)
    buf = io.StringIO()
    stats.stream = buf
    # Reef's and its libraries' own functions: threads' idle waits and this module's client would top the list.
    stats.sort_stats("cumulative").print_stats(INTERESTING, args.top)
    sections.append("cProfile, all threads, by cumulative time (Reef and the libraries it starts; the shutdown "
                    "after the requests included)\n"
                    + "\n".join(line for line in buf.getvalue().splitlines() if line.strip()))
    if args.importtime:
        port = common.free_port()
        sections.append(_importtime(serve_command(port, workdir / "data-it", args.model, []), dict(os.environ),
                                    f"http://127.0.0.1:{port}", 30))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n\n".join(sections) + "\n")
    print("\n\n".join(sections[:2]))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
