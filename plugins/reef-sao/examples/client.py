"""Drive a Reef SAO deployment with the example task stream and watch it learn.

Start a server with the SAO recipe (the tiny profile learns within a minute on CPU)::

    reef serve +recipe=sao +sao_profile=tiny

then run this client::

    python plugins/reef-sao/examples/client.py --base-url http://127.0.0.1:8900 --rollouts 480

For each task of :mod:`reef_sao.tasks` it sends one chat completion through the OpenAI SDK that
``reef_core.api.ReefClient`` wraps (it adds the scenario and keeps each receipt), scores the reply with the
task's verifier, and reports the score on that receipt (``report(references="last")``). At the end it prints
the reward curve (mean per window) and the published releases of the scenario. ``--json PATH`` writes the
rewards and releases for scripts. ``--concurrency N`` runs N such loops at once (the local engine decodes
concurrent requests as one batch); ``--duration S`` stops sending new tasks after S seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from reef_core.api import ReefClient

from reef_sao.tasks import MAX_TOKENS, score, task_stream


def run(base_url: str, scenario: str, rollouts: int | None, *, seed: int = 0, token: str = "reef",
        max_tokens: int | None = None, window: int = 48, quiet: bool = False, concurrency: int = 1,
        duration_s: float | None = None, verifier=score) -> dict:
    """Send ``rollouts`` tasks (endless with None), report their scores; return ``{"rewards": [...], "times": [...],
    "replies": [...], "releases": [...]}`` (``times``: seconds from the start to each report; ``replies``: each
    rollout's prompt, reply and reward).

    ``max_tokens``: each request's reply budget; None: the task's (:data:`reef_sao.tasks.MAX_TOKENS`), 0: the
    engine's ``engine.max_new_tokens``.

    ``concurrency`` clients send tasks at once (each with its own receipts, so ``references="last"`` stays its own
    completion; rewards are listed in the order their reports went out). ``duration_s`` stops starting new tasks
    after that many seconds; the ones already sent finish and count. ``verifier(task, reply)`` scores each reply
    (default :func:`reef_sao.tasks.score`; tests of the loop's plumbing pass ``letter_share``)."""
    if concurrency < 1 or window < 1:
        raise ValueError("concurrency and window must be >= 1")
    if rollouts is None and duration_s is None:
        raise ValueError("give rollouts, duration_s or both")
    max_tokens = MAX_TOKENS if max_tokens is None else max_tokens
    rewards: list[float] = []
    replies: list[dict] = []  # prompt, reply and reward of each rollout, in report order
    times: list[float] = []
    started = time.monotonic()
    deadline = None if duration_s is None else started + duration_s
    tasks = task_stream(rollouts, seed=seed)
    lock = threading.Lock()
    failed = threading.Event()

    def next_task():
        with lock:
            if failed.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None
            return next(tasks, None)

    def worker() -> None:
        with ReefClient(base_url, scenario=scenario, token=token, timeout=120) as reef:
            chat = reef.openai(max_retries=2)
            while (task := next_task()) is not None:
                extra = {"max_tokens": max_tokens} if max_tokens else {}
                completion = chat.chat.completions.create(model="reef", messages=task.messages(),
                                                          temperature=1.0, top_p=1.0, **extra)
                reply = completion.choices[0].message.content or ""
                value = verifier(task, reply)
                reef.report(score=value, references="last")  # the receipt of this worker's completion above
                with lock:
                    rewards.append(value)
                    replies.append({"prompt": task.prompt, "reply": reply, "reward": value})
                    times.append(round(time.monotonic() - started, 3))
                    if not quiet and len(rewards) % window == 0:
                        recent = statistics.mean(rewards[-window:])
                        print(f"{len(rewards):5d} rollouts  mean reward of the last {window}: {recent:.3f}  "
                              f"({time.monotonic() - started:.0f} s)", flush=True)

    if concurrency == 1:
        worker()
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(worker) for _ in range(concurrency)]
            for future in as_completed(futures):
                if future.exception() is not None:
                    failed.set()  # the other workers stop after their current task
            for future in futures:
                future.result()  # re-raises the first failure
    with ReefClient(base_url, scenario=scenario, token=token, timeout=120) as reef:
        releases = reef.releases()
    return {"rewards": rewards, "times": times, "replies": replies, "releases": releases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8900")
    parser.add_argument("--scenario", default="sao-vowels")
    parser.add_argument("--rollouts", type=int, default=480, help="tasks to send (0: until --duration ends)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds: stop starting new tasks after this long (default: no limit)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="clients sending at once (the local engine batches concurrent requests); default 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token", default="reef", help="an inference token (server.tokens), if the server has any")
    parser.add_argument("--max-tokens", type=int, default=None, help=f"reply budget per request (default {MAX_TOKENS}, the task's; 0: the engine's "
                                                                     "max_new_tokens)")
    parser.add_argument("--window", type=int, default=48)
    parser.add_argument("--json", default=None, help="write rewards and releases to this file")
    args = parser.parse_args(argv)
    if args.rollouts < 0 or (args.rollouts == 0 and args.duration is None):
        parser.error("--rollouts must be > 0, or 0 with --duration")
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if args.window < 1:
        parser.error("--window must be >= 1")
    result = run(args.base_url, args.scenario, args.rollouts or None, seed=args.seed, token=args.token,
                 max_tokens=args.max_tokens, window=args.window, concurrency=args.concurrency,
                 duration_s=args.duration)
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
