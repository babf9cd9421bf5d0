"""Pack circles with a Reef TTT deployment: Guidance-TTT on circle packing, with a live progress bar and a plot.

Start a server (the CPU profile: the tiny model as the guide, the CPU executor's geometric operators, n = 26)::

    reef serve +recipe=ttt +ttt_profile=tiny_packing

then run this client::

    python plugins/reef-ttt/examples/circle_packing.py --base-url http://127.0.0.1:8900 --steps 20

Each step it reads the plan (``GET /reef/scenarios/{s}/ttt/plan``: the PUCT parents and their prompts), samples
every group's rollouts through ``/v1/chat/completions``, runs the executor on each reply's guidance, verifies the
child packing, reports ``{score, references: [receipt], metadata: {step, group, rollout, state}}`` and waits for
the step to train. The progress bar shows the archive's best sum of radii. At the end it writes a PNG of the best
packing and the best-score curve (``--png``), and ``--json PATH`` writes the per-step numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from reef_ttt.client import StepResult, TTTClient
from reef_ttt.picture import packing_png
from reef_ttt.tasks.circle_packing import OPERATORS, REFERENCE, operator_for


def _bar(done: int, total: int, text: str, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}"


def run(base_url: str, scenario: str, steps: int, *, png: str | None = "circle_packing.png", token: str = "reef",
        quiet: bool = False) -> dict:
    """Run ``steps`` steps; returns ``{"steps": [...], "best": {...}, "seed_best", "history", "png", "wall_s"}``."""
    client = TTTClient(base_url, scenario, token=token)
    started = time.monotonic()
    seed_best = max(g["parent"]["value"] for g in client.plan()["groups"])
    rows = []

    def show(result: StepResult) -> None:
        best = result.archive["best"]["score"]
        ops = [operator_for(g) for g in result.guidance if g]
        rows.append({"step": result.step, "batch_mean": result.mean, "best": best, "size": result.archive["size"],
                     "malformed": result.malformed, "seconds": round(result.seconds, 3),
                     "operators": {op: ops.count(op) for op in OPERATORS}})
        if not quiet:
            sys.stderr.write(_bar(len(rows), steps, f"best {best:.6f}  batch mean {result.mean:.4f}  "
                                                    f"archive {result.archive['size']}"))
            sys.stderr.flush()

    try:
        client.run(steps, on_step=show)
        archive = client.archive()
    finally:
        client.close()
    if not quiet:
        sys.stderr.write("\n")
    written = None
    if png:
        written = str(packing_png(png, archive["best"]["state"], archive["history"], baseline=seed_best))
    return {"steps": rows, "best": archive["best"], "seed_best": seed_best, "history": archive["history"],
            "png": written, "wall_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8900")
    parser.add_argument("--scenario", default="packing-26")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--token", default="reef")
    parser.add_argument("--png", default="circle_packing.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args.base_url, args.scenario, args.steps, png=args.png, token=args.token)
    n = len(result["best"]["state"])
    reference = REFERENCE.get(n)
    print(f"best sum of radii {result['best']['score']:.6f} (seeds {result['seed_best']:.6f}"
          + (f"; published best {reference:.6f}" if reference else "") + f") in {result['wall_s']} s")
    if result["png"]:
        print(f"picture: {result['png']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
