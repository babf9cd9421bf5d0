"""``python -m bench <name> [options]``: run one benchmark, print its table, write bench/results/<name>.json."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

#: name -> module (each has ``add_arguments(parser)`` and ``run(args) -> dict``)
BENCHMARKS = {
    "proxy": "bench.proxy",
    "throughput": "bench.throughput",
    "store": "bench.store",
    "retention": "bench.retention",
    "publish": "bench.publish",
    "commit": "bench.commit",
    "fuzz": "bench.fuzz",
    "topk": "bench.topk",
    "engine": "bench.engine",
    "stream": "bench.stream",
    "replicas": "bench.replicas",
    "batch": "bench.batch",
    "ready": "bench.ready",
    "learn-smollm2": "bench.learn_smollm2",
    "learn-vllm": "bench.learn_vllm",
    "train": "bench.train",
    "results": "bench.results",
}

#: How each benchmark meets what users run (issue #41: a benchmark measures what the user runs). ``None``: it starts
#: the real ``reef serve`` command line itself and measures through it. Otherwise it times a part alone (a component
#: figure, useful for profiling) and the string names the benchmark that measures the same path through ``reef
#: serve``; ``bench/README.md`` reports the two side by side.
THROUGH_SERVER: dict[str, str | None] = {
    "proxy": None,
    "throughput": None,
    "store": "throughput (every receipt a durable record, at 1 and 64 connections)",
    "retention": "proxy (the records it compacts are what reef serve stored)",
    "publish": None,
    "commit": "publish (commit_ms and publish_latency_ms, measured by reef serve's learner)",
    "fuzz": None,
    "topk": "stream (the served config captures top-K as +recipe=sao does)",
    "engine": "stream",
    "stream": None,
    "replicas": None,
    "batch": "stream --concurrency 8 (N streams through reef serve vs one after another)",
    "ready": None,
    "learn-smollm2": None,
    "learn-vllm": None,
    "train": "publish (train_s of every step from reef serve's commit log)",
    "results": None,
}


def main(argv: list[str] | None = None) -> int:
    epilog = "measured alone (the same path through reef serve): " + "; ".join(
        f"{name} ({via})" for name, via in THROUGH_SERVER.items() if via)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, epilog=epilog)
    sub = parser.add_subparsers(dest="name", metavar="NAME", required=True)
    modules = {}
    for name, path in BENCHMARKS.items():
        module = importlib.import_module(path)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0]))
    args = parser.parse_args(argv)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from bench.common import write_result

    started = time.monotonic()
    result = modules[args.name].run(args)
    result["benchmark"] = args.name
    result["argv"] = sys.argv[1:] if argv is None else argv
    result["total_wall_s"] = round(time.monotonic() - started, 1)
    path = write_result(args.name, result)
    print(f"\nwrote {path} ({result['total_wall_s']} s)")
    return 1 if result.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
