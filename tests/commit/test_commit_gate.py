"""Selection policies on hand-made score vectors, the evaluators, and the fail-closed gate."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from reef_core.commit import (
    Candidate,
    Current,
    Decision,
    EvaluationResult,
    Gate,
    ReplayEvaluator,
    TaskEvaluator,
    always,
    exact_match,
    floor,
    json_schema,
    make_policy,
    paired_confidence,
    python_verifier,
    regex_match,
    run_gate,
    score_comparison,
)
from reef_core.errors import ConfigError

CAND = Candidate("cand-1", "s", "a" * 40)


def ev(scores, baseline=None, task_ids=None) -> EvaluationResult:
    meta = {"task_ids": task_ids} if task_ids else {}
    return EvaluationResult("hand", "1", {}, list(scores), None if baseline is None else list(baseline), meta)


def sign_p(wins: int, losses: int) -> float:
    """Independent reference: 1 - P(X <= wins - 1), X ~ Binomial(n, 1/2)."""
    n = wins + losses
    return 1 - sum(math.comb(n, k) for k in range(wins)) / 2**n


# ------------------------------------------------------------------------------- policies


def test_always_selects():
    e = ev([0.0])
    d = always().decide(CAND, e)
    assert d.selected and d.policy == "always" and d.evaluation is e


def test_score_comparison_counts_wins_minus_losses():
    # pairs: win, win, tie, candidate failed (loses to a real 0), both failed (tie), NaN vs 0.5 (loss)
    e = ev([1.0, 0.7, 0.5, None, None, float("nan")], [0.0, 0.2, 0.5, 0.0, None, 0.5])
    d = score_comparison().decide(CAND, e)
    assert d.metrics == {"wins": 2, "losses": 2, "ties": 2}
    assert not d.selected  # 2 - 2 = 0 is not > 0
    e2 = ev([1.0, 0.7, 0.5, None], [0.0, 0.2, 0.5, 0.0])
    assert score_comparison().decide(CAND, e2).selected  # 2 - 1 = 1 > 0
    assert not score_comparison(min_win_margin=1).decide(CAND, e2).selected
    assert score_comparison().decide(CAND, ev([0.0], [None])).selected  # a real score beats a failure


def test_paired_confidence_clear_win_selects_with_exact_p():
    e = ev([0.9] * 10, [0.1] * 10)
    d = paired_confidence().decide(CAND, e)
    assert d.selected
    assert d.metrics["p_value"] == pytest.approx(sign_p(10, 0)) == pytest.approx(1 / 1024)
    assert d.metrics["bootstrap_lower"] == pytest.approx(0.8)


def test_paired_confidence_sign_test_blocks_a_weak_majority():
    # 6 wins, 2 losses, 2 ties: mean difference is positive but p = 37/256 > 0.05.
    c = [1, 1, 1, 1, 1, 1, 0, 0, 0.5, 0.5]
    b = [0, 0, 0, 0, 0, 0, 1, 1, 0.5, 0.5]
    d = paired_confidence().decide(CAND, ev(c, b))
    assert (d.metrics["wins"], d.metrics["losses"], d.metrics["ties"]) == (6, 2, 2)
    assert d.metrics["p_value"] == pytest.approx(sign_p(6, 2)) == pytest.approx(37 / 256)
    assert not d.selected and "p=" in d.reason
    assert paired_confidence(confidence_level=0.85).decide(CAND, ev(c, b)).metrics["p_value"] <= 0.15


def test_paired_confidence_counts_infra_faults_as_losses():
    c = [1.0] * 9 + [None]
    b = [0.0] * 9 + [0.0]
    d = paired_confidence().decide(CAND, ev(c, b))
    assert (d.metrics["wins"], d.metrics["losses"], d.metrics["faults"]) == (9, 1, 1)
    assert d.metrics["p_value"] == pytest.approx(sign_p(9, 1)) == pytest.approx(11 / 1024)
    # A fault on the current side is not a free win either.
    d2 = paired_confidence().decide(CAND, ev([1.0] * 9 + [1.0], [0.0] * 9 + [None]))
    assert d2.metrics["losses"] == 1 and d2.metrics["valid_pairs"] == 9
    # Nothing valid to compare: reject.
    d3 = paired_confidence(min_valid_pairs=3).decide(CAND, ev([None, 1.0, 1.0], [0.0, 0.0, None]))
    assert not d3.selected and "min_valid_pairs" in d3.reason


def test_paired_confidence_min_effect_and_seeded_bootstrap():
    c = [0.6, 0.55, 0.7, 0.52, 0.61, 0.58, 0.66, 0.6, 0.59, 0.57, 0.63, 0.54]
    b = [0.5] * 12
    e = ev(c, b)
    first = paired_confidence(seed=7).decide(CAND, e)
    again = paired_confidence(seed=7).decide(CAND, e)
    assert first.selected and first.metrics["bootstrap_lower"] == again.metrics["bootstrap_lower"]
    assert 0 < first.metrics["bootstrap_lower"] < first.metrics["mean_difference"]
    assert not paired_confidence(min_effect=0.2).decide(CAND, e).selected


def test_paired_confidence_bootstraps_over_task_means():
    # Two tasks, each run 3 times: the bootstrap resamples 2 task means, not 6 episodes.
    e = ev([1, 1, 1, 0, 0, 0.9], [0, 0, 0, 0.5, 0.5, 0.5], task_ids=["a", "a", "a", "b", "b", "b"])
    d = paired_confidence(bootstrap=500).decide(CAND, e)
    task_means = [1.0, (-0.5 - 0.5 + 0.4) / 3]
    assert d.metrics["mean_difference"] == pytest.approx(sum(task_means) / 2)
    assert d.metrics["bootstrap_lower"] == pytest.approx(task_means[1])  # both draws "b" is likely in 500
    assert not d.selected


def test_floor_needs_every_task():
    assert floor(0.8).decide(CAND, ev([0.9, 0.8, 1.0])).selected
    assert not floor(0.8).decide(CAND, ev([0.9, 0.79])).selected
    assert not floor(0.8).decide(CAND, ev([0.9, None])).selected
    assert not floor(0.0).decide(CAND, ev([])).selected
    # repeats are averaged per task
    assert floor(0.5).decide(CAND, ev([1.0, 0.0, 0.6, 0.6], task_ids=["a", "a", "b", "b"])).selected


def test_make_policy():
    assert make_policy("score_comparison", min_win_margin=2).min_win_margin == 2
    with pytest.raises(ConfigError):
        make_policy("nope")


def test_policies_resolve_through_the_registry_or_one_dotted_loader():
    from reef_core.plugins import PluginManager

    pm = PluginManager(load_entry_points=False)
    assert pm.create("selection_policy", "score_comparison", min_win_margin=2).min_win_margin == 2
    assert pm.create("selection_policy", "reef_core.commit.policies:Always").name == "always"
    assert pm.create("selection_policy", "reef_core.commit.policies:floor", floor_score=0.5).floor_score == 0.5
    with pytest.raises(ConfigError, match="available: always"):
        pm.create("selection_policy", "reef_core.commit.policies.Always")  # a dotted path needs its colon
    with pytest.raises(ConfigError, match="cannot import"):
        pm.create("evaluator", "no_such_module:Evaluator")


# ------------------------------------------------------------------------------- evaluators


def test_scorers(tmp_path, monkeypatch):
    assert exact_match()(" Paris\n", {"expected": "Paris"}) == 1.0
    assert exact_match(case_sensitive=False)("PARIS", {"expected": "paris"}) == 1.0
    chat = {"choices": [{"message": {"content": "Paris"}}]}
    assert exact_match()(chat, {"expected": "Paris"}) == 1.0
    assert regex_match(r"\d+")("answer: 42", {}) == 1.0
    assert regex_match(key="rx", fullmatch=True)("42!", {"rx": r"\d+"}) == 0.0
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    assert json_schema(schema)('{"a": 1}', {}) == 1.0
    assert json_schema(schema)('{"a": "x"}', {}) == 0.0
    assert json_schema()("not json", {"schema": schema}) == 0.0
    (tmp_path / "my_verifiers.py").write_text(
        "def contains(output, task):\n    return task['answer'] in output\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    verify = python_verifier("my_verifiers:contains")
    assert verify("it is 42", {"answer": "42"}) == 1.0 and verify("no", {"answer": "42"}) == 0.0
    with pytest.raises(ConfigError):
        python_verifier("my_verifiers:missing")


def test_task_evaluator_pairs_candidate_and_current():
    calls = []

    def run(subject, task):
        calls.append((type(subject).__name__, task["q"]))
        if isinstance(subject, Current):
            assert subject.release_id == CAND.base_release_id
            return "wrong"
        if task["q"] == "boom":
            raise TimeoutError("engine down")
        return task["expected"]

    tasks = [{"id": "t1", "q": "a", "expected": "A"}, {"id": "t2", "q": "boom", "expected": "B"}]
    evaluator = TaskEvaluator(tasks, run, exact_match(), repeats=2)
    result = evaluator.evaluate(CAND)
    assert result.scores == [1.0, 1.0, None, None]
    assert result.baseline_scores == [0.0, 0.0, 0.0, 0.0]
    assert result.metadata["task_ids"] == ["t1", "t1", "t2", "t2"]
    assert result.metrics["failed_episodes"] == 2 and "engine down" in result.metadata["errors"][0]
    # interleaved per pair: candidate, current, candidate, current, ...
    assert [c[0] for c in calls[:4]] == ["Candidate", "Current", "Candidate", "Current"]


def test_replay_evaluator_uses_reported_scores_as_baseline():
    records = [{"id": "r1", "input": "x", "reported_score": 0.2, "metadata": {"expected": "yes"}},
               {"id": "r2", "input": "y", "reported_score": 0.9, "metadata": {"expected": "yes"}}]
    seen = []

    def run(cand, task):
        seen.append((type(cand).__name__, task["messages"], task["id"]))
        return "yes" if task["messages"] == "x" else "no"

    result = ReplayEvaluator(records, run, exact_match()).evaluate(CAND)
    assert result.scores == [1.0, 0.0] and result.baseline_scores == [0.2, 0.9]
    assert seen == [("Candidate", "x", "r1"), ("Candidate", "y", "r2")]  # only the candidate runs
    assert result.metadata["task_ids"] == ["r1", "r2"]
    d = score_comparison().decide(CAND, result)
    assert d.metrics == {"wins": 1, "losses": 1, "ties": 0} and not d.selected
    with pytest.raises(ConfigError):
        ReplayEvaluator([{"input": "x"}], run, exact_match())


# ------------------------------------------------------------------------------- the gate


class CountingEvaluator:
    name, version = "counting", "1"

    def __init__(self, scores, baseline):
        self.calls = 0
        self.scores, self.baseline = scores, baseline

    def evaluate(self, candidate):
        self.calls += 1
        return EvaluationResult(self.name, self.version, {}, list(self.scores), list(self.baseline))


def test_gate_selects_and_caches_per_candidate():
    evaluator = CountingEvaluator([1.0, 1.0], [0.0, 0.0])
    d1 = run_gate(evaluator, score_comparison(), CAND)
    d2 = run_gate(evaluator, score_comparison(), CAND)
    assert d1.selected and d2.selected and evaluator.calls == 1
    assert d2.evaluation is d1.evaluation
    run_gate(evaluator, score_comparison(), replace(CAND, candidate_id="cand-2"))
    assert evaluator.calls == 2
    assert d1.to_dict()["evaluation"]["scores"] == [1.0, 1.0]


class Raising:
    name, version = "raising", "1"

    def evaluate(self, candidate):
        raise RuntimeError("GPU fell off")

    def decide(self, candidate, evaluation):
        raise ValueError("policy bug")


class WrongEvaluation:
    name, version = "wrong", "1"

    def decide(self, candidate, evaluation):
        return Decision("select", self.name, "ok", replace(evaluation, scores=[9.0]), {})


class Junk:
    name, version = "junk", "1"

    def decide(self, candidate, evaluation):
        return "select"


def test_gate_fails_closed():
    good = CountingEvaluator([1.0], [0.0])
    d = run_gate(Raising(), always(), CAND)
    assert d.decision == "reject" and "GPU fell off" in d.reason and d.evaluation is None
    d = run_gate(good, Raising(), CAND)
    assert d.decision == "reject" and "policy bug" in d.reason and d.evaluation is not None
    d = run_gate(good, WrongEvaluation(), CAND)
    assert d.decision == "reject" and "different evaluation" in d.reason
    d = run_gate(good, Junk(), CAND)
    assert d.decision == "reject" and "not Decision" in d.reason

    class NotAResult:
        name, version = "bad", "1"

        def evaluate(self, candidate):
            return {"scores": [1.0]}

    assert run_gate(NotAResult(), always(), CAND).decision == "reject"
    # An evaluation that failed is not cached: a later run evaluates again.
    gate = Gate(Raising(), always())
    assert gate.run(CAND).decision == "reject" and gate._cache == {}
