"""A DSPy program that improves from production feedback: answer through Reef, report, reload the better program.

    pip install 'reef-gepa[dspy]'
    python plugins/reef-gepa/examples/dspy_program.py               # everything in-process, loopback only
    python plugins/reef-gepa/examples/dspy_program.py --reef-url http://127.0.0.1:8900

With ``--reef-url``, serve Reef with ``+recipe=gepa_dspy``, an engine that answers like
``reef_gepa.examples.dspy_qa:fake_task_model`` and
``recipe.options.reflection_model=reef_gepa.examples.dspy_qa:fake_reflector``. The program, its fake models,
checker and metric are in ``reef_gepa.examples.dspy_qa``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TQDM_DISABLE", "1")  # the in-process learner's GEPA progress bars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reef-url", default=None, help="use this Reef server instead of an in-process one")
    parser.add_argument("--scenario", default="dspy-demo")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dspy").setLevel(logging.WARNING)
    from reef_gepa.examples.dspy_qa import run_dspy_demo

    result = run_dspy_demo(reef_url=args.reef_url, scenario=args.scenario)
    print(f"instructions served now:\n{result['instructions']}")
    return 0 if result["score"] > result["seed_score"] else 1


if __name__ == "__main__":
    sys.exit(main())
