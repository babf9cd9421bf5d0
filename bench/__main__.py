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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
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
