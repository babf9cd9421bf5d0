"""GEPA learning demo: a client pulls the harness, runs tasks through Reef, reports scores with feedback,
and watches the prompt improve release by release.

    python plugins/reef-gepa/examples/learning_demo.py              # everything in-process, loopback only
    python plugins/reef-gepa/examples/learning_demo.py --reef-url http://127.0.0.1:8900

With ``--reef-url``, serve Reef with ``+recipe=gepa``, an engine that answers like
``reef_gepa.examples:task_model`` and ``recipe.options.reflection_model=reef_gepa.examples:reflector``.
See ``reef_gepa.examples`` for the task, its verifier and the stand-in models.
"""

from __future__ import annotations

import argparse
import logging
import sys

from reef_gepa.examples.demo import SCENARIO, run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="minibatches of reports to send")
    parser.add_argument("--reef-url", default=None, help="use this Reef server instead of an in-process one")
    parser.add_argument("--scenario", default=SCENARIO)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    history = run_demo(args.rounds, reef_url=args.reef_url, scenario=args.scenario)
    scores = [row["val_score"] for row in history]
    return 0 if scores and scores[-1] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
