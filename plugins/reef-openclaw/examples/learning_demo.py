"""OpenClaw-RL learning from what the user says next, end to end on loopback, on the tiny CPU model.

    python plugins/reef-openclaw/examples/learning_demo.py [--turns 240] [--arm openclaw|control] [--seed 0]

1. Warms the tiny model up for a few seconds (:func:`reef_openclaw.examples.style.write_warm_model`) so that it
   answers "Yes ..." or "No ..." about evenly, and "Yes ..." when the user's message carries the hint.
2. Starts ``reef serve +recipe=openclaw +openclaw_profile=tiny engine.model=<that model>`` (with
   ``+openclaw_arm=control`` for the control arm); the judge is the scripted user's rule
   (``reef_openclaw.examples.style:judge``).
3. The scripted user (:func:`reef_openclaw.examples.user.run_user`) holds 3-turn sessions and accepts only replies
   that start with "Yes"; it prints the share of accepted replies per 48 turns, then the releases published.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from reef_core.api import ReefProcess
from reef_openclaw.examples.style import write_warm_model
from reef_openclaw.examples.user import run_user


def serve(model_dir: Path, data_dir: Path, arm: str, seed: int, extra: list[str] = ()) -> ReefProcess:
    overrides = ["+recipe=openclaw", "+openclaw_profile=tiny", f"engine.model={model_dir}", f"engine.seed={seed}",
                 f"seed={seed}", *extra]
    if arm == "control":
        overrides.insert(2, "+openclaw_arm=control")
    return ReefProcess(data_dir, overrides, env={"OMP_NUM_THREADS": "1"}).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=240)
    parser.add_argument("--arm", choices=("openclaw", "control"), default="openclaw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the model and the data here")
    parser.add_argument("overrides", nargs="*", help="more `reef serve` overrides (e.g. trainer.lr=3e-4)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a tiny model on a shared CPU: more threads only contend
    work = args.workdir or Path(tempfile.mkdtemp(prefix="reef-openclaw-demo-"))
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        started = time.monotonic()
        summary = write_warm_model(model_dir, seed=args.seed)
        print(f"warm-up: loss {summary['loss']:.3f} in {time.monotonic() - started:.0f} s", flush=True)
    server = serve(model_dir, work / f"data-{args.arm}-{int(time.time())}", args.arm, args.seed, args.overrides)
    try:
        result = run_user(server.url, "claw", args.turns, seed=args.seed)
    finally:
        server.stop()
    accepted = result["accepted"]
    windows = [sum(accepted[i:i + 48]) / len(accepted[i:i + 48]) for i in range(0, len(accepted), 48)]
    print("accepted share per 48 turns:", " ".join(f"{w:.2f}" for w in windows))
    trained = [r for r in result["releases"] if r.get("operation") == "training"]
    print(f"releases published by training: {len(trained)}")
    for row in trained[-3:]:
        metrics = row.get("metrics") or {}
        print(f"  {row.get('release_id')}: reward_mean {metrics.get('reward_mean')}, "
              f"opd rows {metrics.get('opd/rows')}, loss_opd {metrics.get('loss_opd')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
