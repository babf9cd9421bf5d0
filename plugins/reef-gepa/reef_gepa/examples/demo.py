"""The GEPA learning demo, end to end through Reef's HTTP API.

A client (``reef_core.api.ReefClient``) works through training tasks in rounds of one minibatch: it pulls
the harness, runs each task through Reef with the OpenAI SDK it wraps (the pulled system prompt; the
client keeps each receipt), scores the answer with the task's verifier and reports the score with textual
feedback on that receipt. Reef's learner runs one GEPA iteration per minibatch and publishes a
new harness release whenever a candidate beats the served one on the validation tasks; the client
shows the validation score of the prompt it pulls, release by release.

By default everything runs in this process on loopback ports: the rule-based task model and the
deterministic reflector of :mod:`reef_gepa.examples` behind OpenAI-compatible stand-in servers, and a
Reef server (``+recipe=gepa``) whose engine is the task-model stand-in. ``reef_url`` points the client
at a Reef server started elsewhere instead.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from reef_core.api import ReefClient, ReefClientError

from . import feedback, reflector, score_prompt, task_model, tasks, verify
from .standins import serve_chat_model

SCENARIO = "gepa-demo"
PROMPT_FILE = "system_prompt.md"


@contextlib.contextmanager
def serve_reef(task_url: str, reflection_url: str, data_dir: Path, *extra: str) -> Iterator[str]:
    """A Reef server (``+recipe=gepa``) on a free loopback port, served by the task-model stand-in."""
    from reef_core.api import serve_reef as serve

    with serve(["+recipe=gepa", "engine.kind=upstream", f"engine.upstream_url={task_url}", f"storage.data_dir={data_dir}",
                f"recipe.options.reflection_model={{url:'{reflection_url}'}}", *extra]) as url:
        yield url


def pull(client: ReefClient) -> dict | None:
    """The serving harness release, or None before the scenario has one."""
    try:
        return client.harness()
    except ReefClientError as exc:
        if exc.status == 404:
            return None
        raise


def learner_status(client: ReefClient) -> dict:
    try:
        return client.status()
    except ReefClientError:
        return {}


def committed_steps(client: ReefClient) -> int:
    return int(learner_status(client).get("step") or 0)  # None while no learner runs (learning off)


def run_round(client: ReefClient, scenario: str, batch: list[dict], prompt: str | None, *,
              score: Callable[[str, dict], float] = verify,
              answered: list | None = None) -> tuple[list[float], int, set[str]]:
    """Run ``batch`` through Reef with ``prompt``, then report each score (by ``score``, the deployment's
    verifier) with its feedback.

    Returns the scores, the number of committed steps before the reports (the learner commits one step
    per minibatch of reports) and the releases that served the inferences (``x-reef-release-id``).
    ``answered``, when given, gets ``(task, answer, score)`` of each task in order."""
    answers, served_by = [], set()
    chat = client.openai()
    for task in batch:
        messages = ([{"role": "system", "content": prompt}] if prompt else []) + [
            {"role": "user", "content": task["input"]}]
        completion = chat.chat.completions.create(model="stand-in", messages=messages)
        receipt = client.receipts.last()
        served_by.add(receipt.release_id or "")
        answers.append((task, completion.choices[0].message.content, receipt))
    step = committed_steps(client)  # the scenario exists now (its first request created it)
    scores = []
    for task, answer, receipt in answers:
        value = score(answer, task)
        client.report(score=value, feedback=feedback(task, answer, value), references=[receipt],
                      metadata={"task": task})
        scores.append(value)
        if answered is not None:
            answered.append((task, answer, value))
    return scores, step, served_by


def wait_for_step(client: ReefClient, scenario: str, step: int,
                  timeout_s: float = 120.0) -> tuple[dict | None, dict]:
    """Wait until the learner committed ``step`` and, when that step published a release, until the harness
    serves it (the commit-log row lands just before the head moves); return that harness and the row."""
    deadline = time.monotonic() + timeout_s
    row: dict | None = None
    while True:
        if row is None:
            rows = client.commits(after_step=step - 1, limit=1)
            row = rows[0] if rows else None
        if row is not None:
            harness = pull(client)
            published = row.get("release_id")
            if not published or (harness is not None and harness["release_id"] == published):
                return harness, row
        if time.monotonic() > deadline:
            raise TimeoutError(f"the learner did not commit step {step} within {timeout_s} s")
        time.sleep(0.02)


def run_demo(rounds: int = 8, *, minibatch_size: int = 3, reef_url: str | None = None,
             data_dir: Path | None = None, scenario: str = SCENARIO,
             log: Callable[[str], None] = print) -> list[dict]:
    """Run ``rounds`` minibatches; return one row per round (release, its validation score, prompt)."""
    train, val = tasks("train"), tasks("val")
    history: list[dict] = []
    with contextlib.ExitStack() as stack:
        if reef_url is None:
            task_url = stack.enter_context(serve_chat_model(task_model))
            reflection_url = stack.enter_context(serve_chat_model(reflector))
            if data_dir is None:
                data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reef-gepa-demo-")))
            reef_url = stack.enter_context(serve_reef(task_url, reflection_url, data_dir))
        client = stack.enter_context(ReefClient(reef_url, scenario=scenario, timeout=120))
        harness = pull(client)
        cursor = 0
        for index in range(rounds):
            prompt = harness["files"].get(PROMPT_FILE) if harness else None
            batch = [train[(cursor + i) % len(train)] for i in range(minibatch_size)]
            cursor += minibatch_size
            scores, step, served_by = run_round(client, scenario, batch, prompt)
            harness, commit = wait_for_step(client, scenario, step + 1)
            text = harness["files"].get(PROMPT_FILE, "") if harness else ""
            row = {"round": index, "served_by": sorted(served_by),
                   "release_id": harness["release_id"] if harness else None,
                   "minibatch_score": sum(scores) / len(scores), "val_score": score_prompt(text, val),
                   "prompt": text, "metrics": commit.get("metrics") or {}}
            history.append(row)
            log(f"round {index}: minibatch {row['minibatch_score']:.2f} -> release "
                f"{(row['release_id'] or '-')[:12]} validation {row['val_score']:.2f}")
        releases = client.releases()
        log(f"{len(releases)} releases; the prompt served now:\n{history[-1]['prompt'] if history else ''}")
    return history
