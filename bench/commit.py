"""Durable release commit alone: ``Committer.publish`` (stage in git + LFS, fsynced log row, head moved).

The part of a durable publish that the release store owns, without a model or a server: each release holds a few
small files (config, tokenizer) and one weights file of ``--size`` bytes (new random bytes each time, as after a
training step); ``--same-weights`` republishes identical weights (a LoRA release whose adapter did not change, or
the tokenizer files of every release). ``--profile PATH`` writes a cProfile of the publishes (``.pstats``) and its
top entries beside it (``.txt``).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import shutil
import tempfile
import time
from pathlib import Path

from bench import common


def add_arguments(parser) -> None:
    parser.add_argument("--releases", type=int, default=20, help="durable releases to publish (default 20)")
    parser.add_argument("--size", type=int, default=2_000_000,
                        help="bytes of the weights file (default 2 MB, about the tiny model's model.safetensors)")
    parser.add_argument("--same-weights", action="store_true", help="publish the same weights every time")
    parser.add_argument("--profile", default=None, help="write a cProfile to this path (.pstats and .txt)")


def run(args) -> dict:
    from reef_core.commit import GitArtifactStore
    from reef_core.commit.commitlog import CommitLog
    from reef_core.commit.committer import Committer

    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-commit-"))
    try:
        committer = Committer(GitArtifactStore(workdir / "artifacts.git", workdir / "work"),
                              CommitLog.for_scenario(workdir / "log", "bench"), "bench")
        static = {"config.json": b'{"hidden_size": 64}', "tokenizer.json": os.urandom(40_000).hex().encode(),
                  "generation_config.json": b"{}"}
        weights = os.urandom(args.size)
        profiler = cProfile.Profile() if args.profile else None
        head, times = None, []
        for _ in range(args.releases):
            files = {**static, "model.safetensors": weights if args.same_weights else os.urandom(args.size)}
            began = time.perf_counter()
            if profiler:
                profiler.enable()
            release, _row = committer.publish(files, expected_head=head)
            if profiler:
                profiler.disable()
            times.append((time.perf_counter() - began) * 1000)
            head = release.release_id
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = common.percentiles(times)
    mb_s = args.size / 1e6 / (summary["p50"] / 1000) if summary.get("p50") else None
    print(f"{args.releases} durable releases, weights {args.size:,} bytes"
          f"{' (unchanged)' if args.same_weights else ''}: p50 {summary.get('p50')} ms, p99 {summary.get('p99')} ms"
          + (f", {mb_s:.0f} MB/s of weights" if mb_s and not args.same_weights else ""))
    if profiler:
        path = Path(args.profile)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(path.with_suffix(".pstats")))
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        path.with_suffix(".txt").write_text(f"{args.releases} x Committer.publish, weights {args.size} bytes\n"
                                            + text.getvalue())
        print(f"profile: {path.with_suffix('.txt')}")
    return {"machine": common.machine(), "releases": args.releases, "size": args.size,
            "same_weights": args.same_weights, "publish_ms": summary, "times_ms": [round(t, 2) for t in times]}
