"""Selection policies: ``decide(candidate, evaluation) -> Decision``.

Paired policies read ``evaluation.scores[i]`` against ``evaluation.baseline_scores[i]`` (the
current release on the same task). A None or NaN score is an episode that failed to run.

* ``always``: select every candidate.
* ``score_comparison(min_win_margin=0)``: count pairs the candidate wins and loses, a failed
  episode ranking below any real score (two failures tie); select iff
  ``wins - losses > min_win_margin``.
* ``paired_confidence(confidence_level=0.95, min_effect=0.0, bootstrap=2000, seed=0,
  min_valid_pairs=1)``: select iff both

  - the exact one-sided sign test over pairs has ``p <= 1 - confidence_level``:
    ``p = sum_{k=wins}^{n} C(n, k) / 2^n`` with ``n = wins + losses`` (ties dropped), where
    any pair with an infrastructure fault (either side) counts as a candidate loss; and
  - the seeded bootstrap (``bootstrap`` resamples of tasks with replacement) lower
    ``1 - confidence_level`` quantile of the mean per-task difference exceeds ``min_effect``.
    In the per-task differences a faulted pair counts as the largest loss observed: minus the
    spread of real scores in the evaluation (1.0 when there is no spread).

  and at least ``min_valid_pairs`` pairs have two real scores.
* ``floor(floor_score)``: the candidate alone reaches ``floor_score`` (mean over repeats) on
  every task, with no failed episode.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from reef_core.commit.gate import Candidate, Decision, EvaluationResult
from reef_core.errors import ConfigError


def _real(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def sign_test_p_value(wins: int, losses: int) -> float:
    """Exact one-sided sign test: P(X >= wins) for X ~ Binomial(wins + losses, 1/2)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n


def _pairs(evaluation: EvaluationResult) -> list[tuple[float | None, float | None]]:
    if evaluation.baseline_scores is None:
        raise ValueError("this policy compares with the current release: the evaluation has no baseline_scores")
    return [(_real(c), _real(b)) for c, b in zip(evaluation.scores, evaluation.baseline_scores)]


class _Policy:
    name = "policy"
    version = "1"

    def _decide(self, select: bool, reason: str, evaluation: EvaluationResult, metrics: dict) -> Decision:
        return Decision("select" if select else "reject", self.name, reason, evaluation, metrics, self.version)


class Always(_Policy):
    name = "always"

    def decide(self, candidate: Candidate, evaluation: EvaluationResult) -> Decision:
        return self._decide(True, "always selects", evaluation, {})


class ScoreComparison(_Policy):
    name = "score_comparison"

    def __init__(self, min_win_margin: float = 0):
        self.min_win_margin = min_win_margin

    def decide(self, candidate: Candidate, evaluation: EvaluationResult) -> Decision:
        wins = losses = ties = 0
        for c, b in _pairs(evaluation):
            rc = (0, 0.0) if c is None else (1, c)  # a failed episode ranks below any score
            rb = (0, 0.0) if b is None else (1, b)
            if rc > rb:
                wins += 1
            elif rc < rb:
                losses += 1
            else:
                ties += 1
        margin = wins - losses
        select = margin > self.min_win_margin
        reason = (
            f"wins {wins} - losses {losses} = {margin} {'>' if select else '<='} "
            f"min_win_margin {self.min_win_margin}"
        )
        return self._decide(select, reason, evaluation, {"wins": wins, "losses": losses, "ties": ties})


class PairedConfidence(_Policy):
    name = "paired_confidence"

    def __init__(
        self,
        confidence_level: float = 0.95,
        min_effect: float = 0.0,
        bootstrap: int = 2000,
        seed: int = 0,
        min_valid_pairs: int = 1,
    ):
        if not 0.5 <= confidence_level < 1:
            raise ConfigError("confidence_level must be in [0.5, 1)")
        if bootstrap < 1:
            raise ConfigError("bootstrap must be at least 1")
        self.confidence_level = confidence_level
        self.min_effect = min_effect
        self.bootstrap = bootstrap
        self.seed = seed
        self.min_valid_pairs = min_valid_pairs

    def bootstrap_lower_bound(self, task_diffs: list[float]) -> float:
        """Seeded bootstrap lower (1 - confidence) quantile of the mean of ``task_diffs``."""
        rng = random.Random(self.seed)
        n = len(task_diffs)
        means = sorted(sum(rng.choices(task_diffs, k=n)) / n for _ in range(self.bootstrap))
        alpha = 1 - self.confidence_level
        return means[min(int(math.floor(alpha * self.bootstrap)), self.bootstrap - 1)]

    def decide(self, candidate: Candidate, evaluation: EvaluationResult) -> Decision:
        pairs = _pairs(evaluation)
        real = [x for pair in pairs for x in pair if x is not None]
        spread = (max(real) - min(real)) if real else 0.0
        penalty = spread if spread > 0 else 1.0
        task_ids = evaluation.metadata.get("task_ids") or list(range(len(pairs)))
        wins = losses = ties = faults = valid = 0
        per_task: OrderedDict = OrderedDict()
        for (c, b), task in zip(pairs, task_ids):
            if c is None or b is None:
                faults += 1
                losses += 1  # infrastructure faults count as candidate losses
                diff = -penalty
            else:
                valid += 1
                diff = c - b
                if diff > 0:
                    wins += 1
                elif diff < 0:
                    losses += 1
                else:
                    ties += 1
            per_task.setdefault(task, []).append(diff)
        metrics = {"wins": wins, "losses": losses, "ties": ties, "faults": faults, "valid_pairs": valid}
        if valid < self.min_valid_pairs:
            return self._decide(
                False, f"{valid} valid pairs < min_valid_pairs {self.min_valid_pairs}", evaluation, metrics
            )
        alpha = 1 - self.confidence_level
        p = sign_test_p_value(wins, losses)
        diffs = [sum(v) / len(v) for v in per_task.values()]
        lower = self.bootstrap_lower_bound(diffs)
        metrics.update(p_value=p, bootstrap_lower=lower, mean_difference=sum(diffs) / len(diffs))
        select = p <= alpha and lower > self.min_effect
        reason = (
            f"sign test p={p:.4g} {'<=' if p <= alpha else '>'} {alpha:.4g}; bootstrap lower bound "
            f"{lower:.4g} {'>' if lower > self.min_effect else '<='} min_effect {self.min_effect}"
        )
        return self._decide(select, reason, evaluation, metrics)


class Floor(_Policy):
    name = "floor"

    def __init__(self, floor_score: float):
        self.floor_score = float(floor_score)

    def decide(self, candidate: Candidate, evaluation: EvaluationResult) -> Decision:
        task_ids = evaluation.metadata.get("task_ids") or list(range(len(evaluation.scores)))
        per_task: OrderedDict = OrderedDict()
        for score, task in zip(evaluation.scores, task_ids):
            per_task.setdefault(task, []).append(_real(score))
        failing = [
            str(task)
            for task, scores in per_task.items()
            if any(s is None for s in scores) or sum(scores) / len(scores) < self.floor_score
        ]
        metrics = {"tasks": len(per_task), "below_floor": len(failing)}
        if not per_task:
            return self._decide(False, "no task scores to check against the floor", evaluation, metrics)
        if failing:
            reason = f"{len(failing)} of {len(per_task)} tasks below floor {self.floor_score}: {', '.join(failing[:5])}"
            return self._decide(False, reason, evaluation, metrics)
        return self._decide(True, f"all {len(per_task)} tasks reach floor {self.floor_score}", evaluation, metrics)


def always() -> Always:
    return Always()


def score_comparison(min_win_margin: float = 0) -> ScoreComparison:
    return ScoreComparison(min_win_margin)


def paired_confidence(
    confidence_level: float = 0.95,
    min_effect: float = 0.0,
    bootstrap: int = 2000,
    seed: int = 0,
    min_valid_pairs: int = 1,
) -> PairedConfidence:
    return PairedConfidence(confidence_level, min_effect, bootstrap, seed, min_valid_pairs)


def floor(floor_score: float) -> Floor:
    return Floor(floor_score)


POLICIES = {
    "always": always,
    "score_comparison": score_comparison,
    "paired_confidence": paired_confidence,
    "floor": floor,
}


def make_policy(name: str, **options):
    """A built-in policy by name (the built-ins register these through ``reef_register_selection_policies``;
    a custom ``module:Name`` policy is loaded by ``PluginManager.create``)."""
    if name in POLICIES:
        return POLICIES[name](**options)
    raise ConfigError(f"unknown selection policy {name!r}; built-ins: {', '.join(POLICIES)}")
