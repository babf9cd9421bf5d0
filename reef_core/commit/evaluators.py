"""Built-in evaluators: score a candidate (and the current release) on a list of tasks.

Two layers:

* **scorers** ``score(output, task) -> float | None`` judge one output: :func:`exact_match`,
  :func:`regex_match`, :func:`json_schema`, :func:`python_verifier` (``"pkg.mod:func"``);
* **evaluators** (``evaluate(candidate) -> EvaluationResult``):
  :class:`TaskEvaluator` runs ``run(subject, task) -> output`` for the candidate and for the
  current release (:class:`reef_core.commit.gate.Current`) on the same tasks, interleaved per
  pair, and scores both; :class:`ReplayEvaluator` runs and scores the candidate on held-out
  recorded prompts (a processor's hold-out, never trained on) and compares with the scores
  clients reported for them.

The ``run`` callable is the only recipe-specific part: a weight recipe generates with the
candidate weights, a harness recipe runs its agent with the candidate text tree. An episode
whose ``run`` or scorer raises (or scores NaN) is an infrastructure fault: its score is None.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jsonschema

from reef_core.commit.gate import Candidate, Current, EvaluationResult
from reef_core.plugins import load_object  # noqa: F401 - re-exported for plugins
from reef_core.errors import ConfigError

Scorer = Callable[[Any, dict], "float | None"]


def _text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, dict):  # an OpenAI-style chat completion
        try:
            return output["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            pass
    return str(output)


def as_score(value: Any) -> float | None:
    """bool/number -> float; None or NaN -> None (a failed episode)."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def exact_match(*, key: str = "expected", strip: bool = True, case_sensitive: bool = True) -> Scorer:
    """1.0 when the output text equals ``task[key]``."""

    def score(output: Any, task: dict) -> float:
        got, want = _text(output), str(task[key])
        if strip:
            got, want = got.strip(), want.strip()
        if not case_sensitive:
            got, want = got.casefold(), want.casefold()
        return float(got == want)

    return score


def regex_match(pattern: str | None = None, *, key: str = "pattern", fullmatch: bool = False, flags: int = 0) -> Scorer:
    """1.0 when the output matches ``pattern`` (or the task's ``task[key]``)."""
    fixed = re.compile(pattern, flags) if pattern is not None else None

    def score(output: Any, task: dict) -> float:
        rx = fixed or re.compile(task[key], flags)
        text = _text(output)
        return float(bool(rx.fullmatch(text) if fullmatch else rx.search(text)))

    return score


def json_schema(schema: dict | None = None, *, key: str = "schema") -> Scorer:
    """1.0 when the output (JSON text or an object) validates against the schema."""
    if schema is not None:
        jsonschema.Draft202012Validator.check_schema(schema)

    def score(output: Any, task: dict) -> float:
        sch = schema if schema is not None else task[key]
        value = output
        if isinstance(output, (str, bytes)) or isinstance(output, dict) and "choices" in output:
            try:
                value = json.loads(_text(output) if not isinstance(output, bytes) else output)
            except ValueError:
                return 0.0
        return float(jsonschema.Draft202012Validator(sch).is_valid(value))

    return score


def python_verifier(path: str) -> Scorer:
    """A verifier function ``func(output, task) -> bool | float | None`` named by dotted path."""
    func = load_object(path)
    if not callable(func):
        raise ConfigError(f"{path!r} is not callable")

    def score(output: Any, task: dict) -> float | None:
        return as_score(func(output, task))

    return score


SCORERS: dict[str, Callable[..., Scorer]] = {
    "exact_match": exact_match,
    "regex": regex_match,
    "json_schema": json_schema,
    "python": python_verifier,
}


class TaskEvaluator:
    """Paired evaluation: candidate and current release run the same tasks.

    ``run(subject, task) -> output`` where ``subject`` is the :class:`Candidate` or a
    :class:`Current`; ``scorer(output, task)`` scores it. Each task runs ``repeats`` times
    per side, candidate and current interleaved per pair.
    """

    def __init__(
        self,
        tasks: Sequence[dict],
        run: Callable[[Any, dict], Any],
        scorer: Scorer,
        *,
        name: str = "tasks",
        version: str = "1",
        repeats: int = 1,
        compare_current: bool = True,
    ):
        if repeats < 1:
            raise ConfigError("repeats must be at least 1")
        self.tasks = list(tasks)
        self.run = run
        self.scorer = scorer
        self.name = name
        self.version = version
        self.repeats = repeats
        self.compare_current = compare_current

    def _episode(self, subject: Any, task: dict, errors: list[str]) -> float | None:
        try:
            return as_score(self.scorer(self.run(subject, task), task))
        except Exception as exc:  # noqa: BLE001 - an infrastructure fault, scored None
            errors.append(f"{type(exc).__name__}: {exc}")
            return None

    def evaluate(self, candidate: Candidate) -> EvaluationResult:
        current = Current(candidate.scenario, candidate.base_release_id)
        scores: list[float | None] = []
        baseline: list[float | None] = []
        task_ids: list[str] = []
        errors: list[str] = []
        for index, task in enumerate(self.tasks):
            task_id = str(task.get("id", index)) if isinstance(task, dict) else str(index)
            for _ in range(self.repeats):
                scores.append(self._episode(candidate, task, errors))
                if self.compare_current:
                    baseline.append(self._episode(current, task, errors))
                task_ids.append(task_id)
        return EvaluationResult(
            evaluator=self.name,
            version=self.version,
            metrics=_summary(scores, baseline if self.compare_current else None),
            scores=scores,
            baseline_scores=baseline if self.compare_current else None,
            metadata={"task_ids": task_ids, "repeats": self.repeats, "errors": errors[:20]},
        )


class ReplayEvaluator:
    """Held-out recorded tasks ``{id, input, reported_score, metadata}``: the candidate answers each
    ``input`` (the recorded chat messages) through ``run(candidate, task)``, ``scorer(output, task)``
    scores the reply, and the scores clients reported for the release that served them are the
    baseline. ``task`` is the record's ``metadata`` (what the report carried, e.g. an ``expected``
    answer) with the record's own fields and ``messages`` = ``input`` on top."""

    def __init__(
        self,
        records: Sequence[dict],
        run: Callable[[Any, dict], Any],
        scorer: Scorer,
        *,
        name: str = "replay",
        version: str = "2",
    ):
        for i, rec in enumerate(records):
            if not isinstance(rec, dict) or "input" not in rec or "reported_score" not in rec:
                raise ConfigError(f"replay record {i} needs 'input' and 'reported_score'")
        self.records = list(records)
        self.run = run
        self.scorer = scorer
        self.name = name
        self.version = version

    @staticmethod
    def task_of(record: dict) -> dict:
        """The task a replay record stands for (what ``run`` and the scorer see)."""
        metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
        return {**metadata, **record, "messages": record["input"]}

    def evaluate(self, candidate: Candidate) -> EvaluationResult:
        scores: list[float | None] = []
        errors: list[str] = []
        for rec in self.records:
            task = self.task_of(rec)
            try:
                scores.append(as_score(self.scorer(self.run(candidate, task), task)))
            except Exception as exc:  # noqa: BLE001 - an infrastructure fault, scored None
                errors.append(f"{type(exc).__name__}: {exc}")
                scores.append(None)
        baseline = [as_score(rec["reported_score"]) for rec in self.records]
        return EvaluationResult(
            evaluator=self.name,
            version=self.version,
            metrics=_summary(scores, baseline),
            scores=scores,
            baseline_scores=baseline,
            metadata={
                "task_ids": [str(rec.get("id", i)) for i, rec in enumerate(self.records)],
                "errors": errors[:20],
            },
        )


def _mean(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return sum(real) / len(real) if real else None


def _summary(scores: list, baseline: list | None) -> dict:
    out = {
        "episodes": len(scores),
        "mean_score": _mean(scores),
        "failed_episodes": sum(s is None for s in scores),
    }
    if baseline is not None:
        out["baseline_mean_score"] = _mean(baseline)
        out["baseline_failed_episodes"] = sum(s is None for s in baseline)
    return out
