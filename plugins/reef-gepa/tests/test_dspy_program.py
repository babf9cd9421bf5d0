"""A DSPy program improving from production feedback, end to end over HTTP (``+recipe=gepa_dspy``).

One Reef server per outcome: 16 training questions answered by a live program through Reef and reported,
one learner step (dspy.GEPA on the reported examples, then the gate on the held-out ones), the live
program reloaded from the release the scenario then serves.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("dspy")

from reef_gepa.dspy import MANIFEST_FILE, PROGRAM_FILE, load_program  # noqa: E402
from reef_gepa.examples import FACTS  # noqa: E402
from reef_gepa.examples.dspy_qa import SEED_INSTRUCTIONS, CodeQA, run_dspy_demo  # noqa: E402


@pytest.fixture(scope="module")
def selected(tmp_path_factory):
    return run_dspy_demo(data_dir=tmp_path_factory.mktemp("dspy-selected"), log=lambda _line: None)


def test_reloaded_program_scores_higher_than_the_seed(selected):
    decision = selected["commit"]["decision"]
    assert decision["decision"] == "select" and decision["policy"] == "score_comparison", decision
    evaluation = decision["evaluation"]
    assert evaluation["scores"] and sum(evaluation["scores"]) > sum(evaluation["baseline_scores"])
    assert selected["changed"] and selected["release_id"] == selected["commit"]["release_id"]
    assert selected["release_id"] != selected["first_release"]
    assert selected["score"] > selected["seed_score"], selected["instructions"]
    assert any(fact in selected["instructions"] for fact in FACTS.values())
    # The served program's answers were scored by their reports; the candidates' by the checker.
    metrics = selected["commit"]["metrics"]
    assert metrics["metric_calls_reported"] > 0 and metrics["metric_calls_checked"] > 0, metrics
    assert metrics["train_examples"] + metrics["heldout_examples"] == 16 and metrics["heldout_examples"] >= 1
    # The creation release (the seed program) and the one selected release.
    assert sorted(r["release_id"] for r in selected["releases"]) == sorted([selected["first_release"],
                                                                            selected["release_id"]])


def test_release_holds_dspy_json_and_loads_back_into_an_identical_program(selected):
    files = selected["files"]
    assert set(files) == {PROGRAM_FILE, MANIFEST_FILE}
    manifest = json.loads(files[MANIFEST_FILE])
    assert manifest == {"format": 1, "program": "reef_gepa.examples.dspy_qa:CodeQA",
                        "signature": "question -> answer", "predictors": ["answer"]}
    state = json.loads(files[PROGRAM_FILE])
    assert state["answer"]["signature"]["instructions"] == selected["instructions"] != SEED_INSTRUCTIONS
    assert state == selected["program"].dump_state()
    again = load_program(files)
    assert isinstance(again, CodeQA) and again.dump_state() == selected["program"].dump_state()


def test_rejected_candidate_leaves_the_served_program_unchanged(tmp_path):
    # A floor no candidate reaches: dspy.GEPA proposes, the gate evaluates and rejects.
    result = run_dspy_demo(data_dir=tmp_path, log=lambda _line: None,
                           extra=("evaluation.policy=floor", "+evaluation.options.policy.floor_score=2.0"))
    decision = result["commit"]["decision"]
    assert decision["decision"] == "reject" and "floor" in decision["reason"]
    assert decision["evaluation"]["scores"]  # the candidate was evaluated on held-out examples
    assert not result["changed"] and result["release_id"] == result["first_release"]
    assert result["instructions"] == SEED_INSTRUCTIONS and result["score"] == result["seed_score"]
    assert [r["release_id"] for r in result["releases"]] == [result["first_release"]]
