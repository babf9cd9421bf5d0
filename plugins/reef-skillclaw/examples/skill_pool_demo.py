"""SkillClaw on a CPU in seconds: a shared skill pool grows night by night; a frozen control does not.

    python plugins/reef-skillclaw/examples/skill_pool_demo.py [--days 4]

Everything runs in this process on loopback ports (see ``reef_skillclaw.examples.demo``): a deterministic
agent behind an OpenAI-compatible server is Reef's engine, a deterministic evolver model runs the nights, and
two scenarios live the same days: the method (reports every graded session) and the control (reports nothing,
so its pool never changes). Prints each day's pass rate per category for both.
"""

from __future__ import annotations

import argparse

from reef_skillclaw.examples.demo import run_demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=4)
    args = parser.parse_args()
    run_demo(days=args.days)


if __name__ == "__main__":
    main()
