"""The evaluation gate: evaluate a candidate, then decide ``select`` or ``reject``.

:func:`run_gate` enforces the contract every recipe relies on:

* order: ``evaluator.evaluate(candidate)`` first, then ``policy.decide(candidate, evaluation)``
  with exactly that evaluation;
* the decision must carry the same evaluation it was given;
* any exception (or malformed result) rejects the candidate, with the error as the reason
  (fail closed);
* evaluation is idempotent per ``candidate_id``: results are cached per evaluator, so a retry
  never re-runs (or re-rolls) an evaluation.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class Candidate:
    """A proposed update competing with the scenario's current release ``base_release_id``.

    ``files`` for artifact candidates (weights, harness text tree), ``payload`` for anything
    in memory (e.g. a live model handle); ``metadata`` is free-form provenance.
    """

    candidate_id: str
    scenario: str
    base_release_id: str | None
    files: Mapping[str, bytes] | None = None
    payload: Any = None
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Current:
    """The serving side of a paired comparison: the scenario's current release."""

    scenario: str
    release_id: str | None


@dataclass(frozen=True)
class EvaluationResult:
    """Scores of one candidate. ``scores[i]`` pairs with ``baseline_scores[i]`` (the current
    release on the same task and repeat); None marks an episode that failed to run.
    ``metadata["task_ids"]``, when present, names the task of each score."""

    evaluator: str
    version: str
    metrics: dict
    scores: list
    baseline_scores: list | None = None
    metadata: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return _clean(asdict(self))


@dataclass(frozen=True)
class Decision:
    decision: Literal["select", "reject"]
    policy: str
    reason: str
    evaluation: EvaluationResult | None
    metrics: dict = field(default_factory=dict)
    policy_version: str = "1"

    @property
    def selected(self) -> bool:
        return self.decision == "select"

    def to_dict(self) -> dict:
        return {
            "decision": self.decision,
            "policy": self.policy,
            "policy_version": self.policy_version,
            "reason": self.reason,
            "evaluation": self.evaluation.to_dict() if self.evaluation else None,
            "metrics": _clean(self.metrics),
        }


@runtime_checkable
class Evaluator(Protocol):
    name: str
    version: str

    def evaluate(self, candidate: Candidate) -> EvaluationResult: ...


@runtime_checkable
class SelectionPolicy(Protocol):
    name: str
    version: str

    def decide(self, candidate: Candidate, evaluation: EvaluationResult) -> Decision: ...


def _clean(value):
    """JSON-safe copy: NaN/inf become None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


_CACHES: "weakref.WeakKeyDictionary[Any, dict[str, EvaluationResult]]" = weakref.WeakKeyDictionary()


def _check_result(result: Any) -> EvaluationResult:
    if not isinstance(result, EvaluationResult):
        raise TypeError(f"evaluate() returned {type(result).__name__}, not EvaluationResult")
    if not isinstance(result.scores, list):
        raise TypeError("EvaluationResult.scores must be a list")
    if result.baseline_scores is not None and len(result.baseline_scores) != len(result.scores):
        raise ValueError("baseline_scores must pair one-to-one with scores")
    return result


class Gate:
    """An evaluator and a selection policy, with the per-candidate evaluation cache."""

    def __init__(self, evaluator: Evaluator, policy: SelectionPolicy):
        self.evaluator = evaluator
        self.policy = policy
        self._cache: dict[str, EvaluationResult] = {}

    def evaluate(self, candidate: Candidate) -> EvaluationResult:
        """Evaluate once per ``candidate_id``; later calls return the first result."""
        cached = self._cache.get(candidate.candidate_id)
        if cached is None:
            cached = _check_result(self.evaluator.evaluate(candidate))
            self._cache[candidate.candidate_id] = cached
        return cached

    def run(self, candidate: Candidate) -> Decision:
        policy_name = str(getattr(self.policy, "name", type(self.policy).__name__))
        policy_version = str(getattr(self.policy, "version", "1"))

        def reject(reason: str, evaluation: EvaluationResult | None) -> Decision:
            return Decision("reject", policy_name, reason, evaluation, {"gate_error": True}, policy_version)

        try:
            evaluation = self.evaluate(candidate)
        except Exception as exc:  # noqa: BLE001 - fail closed on anything
            return reject(f"evaluation failed: {type(exc).__name__}: {exc}", None)
        try:
            decision = self.policy.decide(candidate, evaluation)
        except Exception as exc:  # noqa: BLE001
            return reject(f"selection policy failed: {type(exc).__name__}: {exc}", evaluation)
        if not isinstance(decision, Decision):
            return reject(f"selection policy returned {type(decision).__name__}, not Decision", evaluation)
        if decision.decision not in ("select", "reject"):
            return reject(f"selection policy returned unknown decision {decision.decision!r}", evaluation)
        if decision.evaluation is not evaluation and decision.evaluation != evaluation:
            return reject("selection policy returned a decision for a different evaluation", evaluation)
        return decision


def run_gate(evaluator: Evaluator, policy: SelectionPolicy, candidate: Candidate) -> Decision:
    """Evaluate ``candidate`` then decide; never raises (any failure rejects).

    Evaluations are cached per evaluator object and candidate id across calls (when the
    evaluator can be weakly referenced; use :class:`Gate` to own the cache explicitly).
    """
    gate = Gate(evaluator, policy)
    try:
        gate._cache = _CACHES.setdefault(evaluator, {})
    except TypeError:  # not weak-referenceable: cache for this call only
        pass
    return gate.run(candidate)
