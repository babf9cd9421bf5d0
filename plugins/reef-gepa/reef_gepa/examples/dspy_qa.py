"""A DSPy program that improves from production feedback through Reef (``+recipe=gepa_dspy``).

The program (:class:`CodeQA`) is one ``dspy.Predict`` of ``question -> answer``: the code of an item in one
of the four categories of :mod:`reef_gepa.examples`. Its deterministic stand-ins (CPU tests and demos only):

* :func:`fake_task_model`: a chat model that reads DSPy's chat-adapter request and answers a category-``c``
  question right only when the predictor's instructions (in the system prompt) state ``FACTS[c]``;
* :func:`fake_reflector`: GEPA's reflection LM, answering DSPy's instruction-proposal request with the
  current instruction plus the first fact the feedback names that it lacks.

:func:`check` is the application's checker (score and feedback on each answer, as a client reports them),
and :func:`metric` the same checker as the trainer's metric. :func:`run_dspy_demo` runs the loop end to end
on loopback ports: a live program answers training questions through Reef, the client reports each
answer's score and feedback (with the expected answer as ``metadata.labels``), Reef's learner compiles a
better program with dspy.GEPA, the gate compares it with the served one on held-out reported examples, and
the live program reloads the new release without a restart.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from reef_core.api import ReefClient

from reef_gepa.dspy import LiveProgram, chat_lm, import_dspy, reef_lm

from . import CODES, FACTS, feedback, task_model, tasks

dspy = import_dspy()

SCENARIO = "dspy-demo"
SEED_INSTRUCTIONS = "Answer with the code of the item."
_FIELD = re.compile(r"\[\[ ## (\w+) ## \]\]\n")


class CodeQA(dspy.Module):
    """question -> answer, one predictor; its instructions are what GEPA rewrites."""

    signature = "question -> answer"

    def __init__(self):
        super().__init__()
        self.answer = dspy.Predict(dspy.Signature("question -> answer", SEED_INSTRUCTIONS))

    def forward(self, question: str):
        return self.answer(question=question)


def _section(text: str, name: str) -> str | None:
    """The value of DSPy's ``[[ ## name ## ]]`` section in ``text``."""
    found = list(_FIELD.finditer(text))
    for i, match in enumerate(found):
        if match.group(1) == name:
            end = found[i + 1].start() if i + 1 < len(found) else len(text)
            return text[match.end():end].strip()
    return None


def _reply(**fields: str) -> str:
    return "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in fields.items()) + "[[ ## completed ## ]]"


def fake_task_model(messages: list[dict]) -> str:
    """A fake chat model: the question's code iff the system prompt (the instructions) states its fact."""
    user = [m for m in messages if m.get("role") == "user"]
    text = user[-1].get("content") if user else ""
    question = _section(text if isinstance(text, str) else "", "question") or ""
    system = [m for m in messages if m.get("role") == "system"]
    return _reply(answer=task_model([*system, {"role": "user", "content": question}]))


def fake_reflector(messages: list[dict]) -> str:
    """A fake reflection LM: the current instruction plus the first fact the shown feedback names that the
    instruction lacks (unchanged when there is none), as the JSON object DSPy's proposer asks for."""
    text = messages[-1]["content"] if messages else ""
    current = _section(text, "current_instruction") or ""
    found = sorted((text.find(fact), fact) for fact in FACTS.values() if fact in text and fact not in current)
    return json.dumps({"new_instruction": "\n".join([current.rstrip(), *(fact for _, fact in found[:1])]).strip()})


def check(question_task: dict, answer: str) -> tuple[float, str]:
    """The application's checker: score and feedback of an answer."""
    score = 1.0 if str(answer).strip() == question_task["answer"] else 0.0
    return score, feedback(question_task, answer, score)


def metric(example, prediction) -> dict:
    """The trainer's checker (``recipe.options.metric``): the labels the client reported are on the example."""
    task = {"answer": example.answer, "category": example.category}
    score, text = check(task, prediction.get("answer", ""))
    return {"score": score, "feedback": text}


def validation_score(program, lm, val: list[dict]) -> float:
    """Mean checker score of ``program`` on ``val`` (run with ``lm``, outside Reef: nothing is recorded)."""
    with dspy.context(lm=lm):
        scores = [check(t, program(question=t["input"]).answer)[0] for t in val]
    return sum(scores) / len(scores)


@contextlib.contextmanager
def serve_reef(task_url: str, data_dir: Path, *extra: str) -> Iterator[str]:
    """A Reef server (``+recipe=gepa_dspy``) on a free loopback port, served by the fake task model."""
    from reef_core.api import serve_reef as serve

    with serve(["+recipe=gepa_dspy", "engine.kind=upstream", f"engine.upstream_url={task_url}",
                f"storage.data_dir={data_dir}",
                "recipe.options.reflection_model=reef_gepa.examples.dspy_qa:fake_reflector", *extra]) as url:
        yield url


def wait_for_step(client: ReefClient, step: int, timeout_s: float = 60.0) -> dict:
    """The commit-log row of learner step ``step`` (polled until it lands)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = client.commits(after_step=step - 1, limit=1)
        if rows:
            return rows[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the learner did not commit step {step} within {timeout_s} s")
        time.sleep(0.05)


def _follow(live: LiveProgram, release_id: str, timeout_s: float = 30.0) -> bool:
    """Refresh ``live`` until it runs ``release_id`` (the commit-log row lands just before the head moves)."""
    changed = False
    deadline = time.monotonic() + timeout_s
    while True:
        changed = live.refresh() or changed
        if live.release_id == release_id:
            return changed
        if time.monotonic() > deadline:
            raise TimeoutError(f"release {release_id} was not served within {timeout_s} s")
        time.sleep(0.05)


def run_dspy_demo(*, reef_url: str | None = None, data_dir: Path | None = None, scenario: str = SCENARIO,
                  per_category: int = 4, extra: tuple[str, ...] = (), log: Callable[[str], None] = print) -> dict:
    """One round: serve, answer and report ``4 * per_category`` training questions, wait for the learner's
    step, reload the live program. Returns the scores, releases and the commit-log row of the step."""
    from .standins import serve_chat_model

    train, val = tasks("train", per_category), tasks("val", 4)
    direct = chat_lm(fake_task_model, "fake-task-model")  # validation runs outside Reef
    with contextlib.ExitStack() as stack:
        if reef_url is None:
            task_url = stack.enter_context(serve_chat_model(fake_task_model, model="fake-task-model"))
            if data_dir is None:
                data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reef-dspy-demo-")))
            reef_url = stack.enter_context(serve_reef(task_url, data_dir, *extra))
        client = stack.enter_context(ReefClient(reef_url, scenario=scenario, timeout=120))
        live = LiveProgram(client, seed=CodeQA(), lm=reef_lm(client, "fake-task-model"), poll_interval_s=3600)
        seed_score = validation_score(live.program, direct, val)
        log(f"seed program: validation {seed_score:.2f}")
        answered = []
        for task in train:
            answer = live(question=task["input"]).answer
            answered.append((task, answer, client.receipts.last()))
        live.refresh()  # the first request created the scenario with its creation release: the seed program
        first_release = live.release_id
        step = int(client.status().get("step", 0))
        for task, answer, receipt in answered:
            score, text = check(task, answer)
            client.report(score=score, feedback=text, references=[receipt],
                          metadata={"labels": {"answer": task["answer"], "category": task["category"]}})
        row = wait_for_step(client, step + 1)
        changed = _follow(live, row.get("release_id") or first_release)
        score = validation_score(live.program, direct, val)
        decision = row.get("decision") or {}
        log(f"step {step + 1}: {decision.get('decision', 'no candidate')} ({decision.get('reason')}); "
            f"release {(live.release_id or '-')[:12]}, validation {score:.2f}")
        return {"seed_score": seed_score, "score": score, "changed": changed, "first_release": first_release,
                "release_id": live.release_id, "commit": row, "program": live.program, "files": live.files,
                "releases": client.releases(), "instructions": live.program.answer.signature.instructions,
                "codes": CODES}
