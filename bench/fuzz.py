"""Long property-based fuzz run over every route (issue #12): no 5xx, no dropped connection, no scenario created
by a refused request, RSS growth bounded.

The same strategies and invariants as ``tests/test_fuzz.py`` (``reef_core/testing/fuzz``), with more cases and a
fresh seed per run unless ``--seed`` is given: ``reef serve`` in front of the stub (``--engine upstream``, the
default) or on the tiny embedded model (``--engine local``), with an inference and an admin token and a harness
(gepa) route beside the default recipe. Prints every distinct failure with its smallest example; exits 1 when any
invariant failed.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import common

RSS_LIMIT_MIB = 150


def add_arguments(parser) -> None:
    parser.add_argument("--cases", type=int, default=20000, help="cases over all routes (default 20000)")
    parser.add_argument("--seed", type=int, default=None, help="fixed seed (default: a new one, printed)")
    parser.add_argument("--engine", choices=("upstream", "local"), default="upstream",
                        help="upstream (the stub, fast) or local (engine.model=tiny)")
    parser.add_argument("--routes", default=None, help="comma-separated 'METHOD /path' to fuzz (default: all)")


def _start_local(data_dir: Path, overrides: list[str]) -> common.Child:
    port = common.free_port()
    cmd = [common.PYTHON, "-m", "reef_core.cli", "serve", "engine.kind=local", "engine.model=tiny",
           "engine.max_new_tokens=4", f"server.port={port}", f"storage.data_dir={data_dir}", *overrides]
    return common.Child("reef", cmd, f"http://127.0.0.1:{port}", data_dir.parent / "reef.log",
                        unset=("REEF_TOKEN", "REEF_ADMIN_TOKEN")).start(timeout=600)


def run(args) -> dict:
    from reef_core.testing.fuzz import fuzz, prepare, server_overrides

    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    machine = common.machine()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-fuzz-"))
    children = []
    try:
        if args.engine == "upstream":
            stub = common.start_stub(workdir)
            children.append(stub)
            reef = common.start_reef(stub.url, workdir / "data", *server_overrides())
        else:
            reef = _start_local(workdir / "data", server_overrides())
        children.append(reef)
        port = int(reef.url.rsplit(":", 1)[1])
        target = prepare("127.0.0.1", port, reef.pid, reef.log_path)
        routes = [r.strip() for r in args.routes.split(",")] if args.routes else None
        last = [time.monotonic()]

        def progress(result) -> None:
            if time.monotonic() - last[0] > 10:
                last[0] = time.monotonic()
                print(f"  {result.cases} cases, {len(result.failures)} distinct failures", file=sys.stderr)

        print(f"fuzz: {args.cases} cases, seed {seed}, engine {args.engine}")
        result = fuzz(target, args.cases, seed=seed, routes=routes, progress=progress)
        alive = reef.proc.poll() is None
    finally:
        for child in reversed(children):
            child.stop()
    print(result.report())
    problems = [f"{f.invariant}: {f.op} -> {f.status}: {f.cause}" for f in result.failures.values()]
    if result.rss_growth_mib >= RSS_LIMIT_MIB:
        problems.append(f"RSS grew by {result.rss_growth_mib:.0f} MiB (limit {RSS_LIMIT_MIB})")
    if not alive:
        problems.append("the server exited during the run")
    print(f"\n{result.cases} cases, seed {seed}: " + (f"{len(problems)} problem(s)" if problems else "all invariants held"))
    shutil.rmtree(workdir, ignore_errors=True)
    return {"machine": machine, "seed": seed, "engine": args.engine, **result.to_dict(), "problems": problems}
