"""Drive a Reef SAO deployment with the example task stream and watch it learn.

Start a server with the SAO recipe (the tiny profile learns within a minute on CPU)::

    reef serve +recipe=sao +sao_profile=tiny

then run this client::

    python plugins/reef-sao/examples/client.py --base-url http://127.0.0.1:8900 --rollouts 480

For each task of :mod:`reef_sao.tasks` it sends one chat completion through the OpenAI SDK that
``reef_core.api.ReefClient`` wraps (it adds the scenario and keeps each receipt), scores the reply with the
task's verifier, and reports the score on that receipt (``report(references="last")``). At the end it prints
the reward curve (mean per window) and the published releases of the scenario. ``--json PATH`` writes the
rewards and releases for scripts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from reef_core.api import ReefClient

from reef_sao.tasks import score, task_stream


def run(base_url: str, scenario: str, rollouts: int, *, seed: int = 0, token: str = "reef",
        max_tokens: int | None = None, window: int = 48, quiet: bool = False) -> dict:
    """Send ``rollouts`` tasks, report their scores; return ``{"rewards": [...], "releases": [...]}``."""
    rewards: list[float] = []
    started = time.monotonic()
    with ReefClient(base_url, scenario=scenario, token=token, timeout=120) as reef:
        chat = reef.openai(max_retries=2)
        for task in task_stream(rollouts, seed=seed):
            extra = {"max_tokens": max_tokens} if max_tokens else {}
            completion = chat.chat.completions.create(model="reef", messages=task.messages(), temperature=1.0,
                                                      top_p=1.0, **extra)
            value = score(task, completion.choices[0].message.content or "")
            rewards.append(value)
            reef.report(score=value, references="last")  # the receipt of the completion just above
            if not quiet and len(rewards) % window == 0:
                recent = statistics.mean(rewards[-window:])
                print(f"{len(rewards):5d} rollouts  mean reward of the last {window}: {recent:.3f}  "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
        releases = reef.releases()
    return {"rewards": rewards, "releases": releases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8900")
    parser.add_argument("--scenario", default="sao-vowels")
    parser.add_argument("--rollouts", type=int, default=480)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token", default="reef", help="an inference token (server.tokens), if the server has any")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the engine's max_new_tokens")
    parser.add_argument("--window", type=int, default=48)
    parser.add_argument("--json", default=None, help="write rewards and releases to this file")
    args = parser.parse_args(argv)
    result = run(args.base_url, args.scenario, args.rollouts, seed=args.seed, token=args.token,
                 max_tokens=args.max_tokens, window=args.window)
    rewards = result["rewards"]
    w = min(args.window, len(rewards))
    if w:
        first, last = statistics.mean(rewards[:w]), statistics.mean(rewards[-w:])
        print(f"mean reward: first {w} = {first:.3f}, last {w} = {last:.3f} ({last - first:+.3f})")
    print(f"{len(result['releases'])} release(s) of scenario {args.scenario}:")
    for row in result["releases"]:
        metrics = row.get("metrics") or {}
        reward = metrics.get("reward_mean")
        print(f"  {row.get('release_id')}  {row.get('operation', ''):9s} current={row.get('current')} "
              f"reward_mean={reward if reward is None else round(reward, 3)} "
              f"serving_version={metrics.get('serving_version')}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
