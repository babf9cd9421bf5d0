"""Differential oracle: the ``gepa`` trainer walks upstream ``gepa.optimize``'s exact trajectory.

The deterministic hash task of recipes §7.5 (45 train / 45 validation tasks, seed 0, budget 400):
upstream runs with plain Python callables; the trainer runs one iteration per batch, its task and
reflection models being the same functions behind loopback OpenAI-compatible servers, with the gate
(paired task evaluation + ``score_comparison``) between iterations and batches of served traffic.
Candidates, parents, validation means, per-iteration parent/minibatch draws and the budget spent must
all be identical.

Note: recipes §12.3 quotes upstream means [0.378, 0.444, 0.378, 0.444, 0.400, 0.533] for this task;
the installed gepa 0.1.4 produces a different (but equally deterministic) sequence for every rendering
of the task we tried, so the oracle is the library run here, not those numbers.
"""

from __future__ import annotations

import random
import uuid

import gepa
import pytest
from gepa.core.adapter import EvaluationBatch
from gepa.core.state import GEPAState

from reef_core.api import Batch, Candidate, Sample, Segment, TrainContext, TrainerSetup, render_system_prompt
from reef_core.testing import ScoreComparison, TaskEvaluator, python_verifier, run_gate, serve_asgi
from reef_gepa.examples import hash_task as H
from reef_gepa.examples.standins import chat_app
from reef_gepa.options import GepaOptions
from reef_gepa.trainer import GepaTrainer

TRAIN, VAL = H.train_tasks(), H.val_tasks()
TRACE_KEYS = ("i", "selected_program_candidate", "subsample_ids", "subsample_scores", "new_subsample_scores",
              "new_program_idx", "merged", "merged_entities")


class UpstreamAdapter:
    """The task for ``gepa.optimize``: same answers, scores and feedback, computed in-process."""

    propose_new_texts = None

    def __init__(self, components):
        self.components = components

    def evaluate(self, batch, candidate, capture_traces=False):
        text = render_system_prompt(candidate, self.components)
        outputs = [H.answer(text, task["input"]) for task in batch]
        scores = [H.score_of(o) for o in outputs]
        traces = None
        if capture_traces:
            traces = [{"task": t, "output": o, "score": s} for t, o, s in zip(batch, outputs, scores)]
        return EvaluationBatch(outputs=outputs, scores=scores, trajectories=traces)

    def make_reflective_dataset(self, candidate, eval_batch, components_to_update):
        records = [{"Inputs": t["task"]["input"], "Generated Outputs": t["output"],
                    "Feedback": H.feedback(t["task"], t["output"], t["score"])} for t in eval_batch.trajectories]
        return {c: records for c in components_to_update}


class _Quiet:
    def log(self, *args, **kwargs):
        pass


def run_upstream(run_dir, seed_candidate, budget, use_merge=False):
    result = gepa.optimize(seed_candidate=dict(seed_candidate), trainset=list(TRAIN), valset=list(VAL),
                           adapter=UpstreamAdapter(list(seed_candidate)), reflection_lm=H.reflect,
                           max_metric_calls=budget, seed=0, skip_perfect_score=True, use_merge=use_merge,
                           logger=_Quiet(), run_dir=str(run_dir))
    return result, GEPAState.load(str(run_dir))


def traffic(tree, rng, scenario):
    """Three served answers on random training tasks, reported with score and feedback."""
    system = render_system_prompt(tree, sorted(tree))
    samples = []
    for task in rng.sample(TRAIN, 3):
        output = H.answer(system, task["input"])
        rid = uuid.uuid4().hex
        samples.append(Sample(scenario, [{"role": "system", "content": system},
                                         {"role": "user", "content": task["input"]},
                                         {"role": "assistant", "content": output}],
                              [Segment(2, rid, None)], reward=H.score_of(output),
                              feedback=H.feedback(task, output, H.score_of(output)), metadata={"task": task},
                              source_ids=[rid, f"report-{rid}"], report_id=f"report-{rid}"))
    return Batch(uuid.uuid4().hex, samples, [s.report_id for s in samples], scenario)


def run_reef(data_dir, seed_candidate, budget, task_model, reflection_model, use_merge=False):
    """Drive the trainer as the learner does: train, gate, publish (accepted) or not (rejected)."""
    options = GepaOptions.from_config({
        "trainset": TRAIN, "valset": VAL, "components": list(seed_candidate), "initial_files": dict(seed_candidate),
        "verifier": "reef_gepa.examples.hash_task:verify", "feedback": "reef_gepa.examples.hash_task:feedback",
        "task_model": task_model, "reflection_model": reflection_model, "max_metric_calls": budget, "seed": 0,
        "use_merge": use_merge})
    trainer = GepaTrainer("hash", options, TrainerSetup(data_dir=data_dir, seed=123))
    tree, release, served_means = dict(seed_candidate), None, []
    rng = random.Random(7)
    for step in range(1, 200):
        ctx = TrainContext("hash", step, release, release, None,
                           lambda tree=tree: {k: v.encode() for k, v in tree.items()})
        update = trainer.train(traffic(tree, rng, "hash"), ctx)
        if update is not None:
            evaluator = TaskEvaluator(update.eval_tasks, trainer.run_task,
                                      python_verifier("reef_gepa.examples.hash_task:verify"))
            decision = run_gate(evaluator, ScoreComparison(), Candidate(f"c{step}", "hash", release, None,
                                                                        update.payload))
            if decision.selected:
                release, tree = uuid.uuid4().hex, dict(update.payload)
                trainer.accepted(update, release)
                served_means.append(update.metrics["val_mean"])
            else:
                trainer.rejected(update)
        if trainer.archive.state.total_num_evals >= budget:
            break
    return trainer, served_means


def assert_same_run(result, upstream_state, trainer):
    state = trainer.archive.state
    assert [c for c in state.program_candidates] == list(result.candidates)
    assert state.parent_program_for_candidate == [list(p) for p in result.parents]
    assert [round(trainer.archive.mean(i), 9) for i in range(len(state.program_candidates))] == [
        round(s, 9) for s in result.val_aggregate_scores]
    assert state.prog_candidate_val_subscores == upstream_state.prog_candidate_val_subscores
    assert state.i == upstream_state.i
    assert state.total_num_evals == result.total_metric_calls == upstream_state.total_num_evals
    mine = [{k: e[k] for k in TRACE_KEYS if k in e} for e in state.full_program_trace]
    theirs = [{k: e[k] for k in TRACE_KEYS if k in e} for e in upstream_state.full_program_trace]
    assert mine == theirs


def test_trainer_matches_gepa_optimize_on_the_hash_task(tmp_path):
    seed = {"system_prompt.md": H.SEED_TEXT}
    result, upstream_state = run_upstream(tmp_path / "upstream", seed, budget=400)
    task_app, reflect_app = chat_app(H.task_model), chat_app(H.reflector)
    with serve_asgi(task_app) as task_url, serve_asgi(reflect_app) as reflect_url:
        trainer, served_means = run_reef(tmp_path / "reef", seed, 400, {"url": task_url}, {"url": reflect_url})
    assert_same_run(result, upstream_state, trainer)
    assert len(result.candidates) >= 4, "the oracle must accept several candidates to mean anything"
    assert task_app.state.calls > 0 and reflect_app.state.calls > 0  # the models really ran behind HTTP
    # Reef serves GEPA's best: every publication strictly improved, and it ends on upstream's best.
    assert served_means == sorted(set(served_means)) and served_means
    assert trainer.archive.served == result.best_idx
    # The per-task Pareto front made a candidate that was not the best at the time a parent at least once.
    means, known, below_best = result.val_aggregate_scores, 1, 0
    for entry in trainer.archive.state.full_program_trace:
        parent = entry.get("selected_program_candidate")
        if parent is not None and means[parent] < max(means[:known]):
            below_best += 1
        known = max(known, entry.get("new_program_idx", -1) + 1)
    assert below_best > 0


def test_trainer_matches_gepa_optimize_with_merge(tmp_path):
    seed = {"rules.md": H.SEED_TEXT, "style.md": "Be terse."}  # two components: merges have something to mix
    result, upstream_state = run_upstream(tmp_path / "upstream", seed, budget=500, use_merge=True)
    trainer, _ = run_reef(tmp_path / "reef", seed, 500, "reef_gepa.examples.hash_task:task_model",
                          "reef_gepa.examples.hash_task:reflector", use_merge=True)
    assert_same_run(result, upstream_state, trainer)
    merged = [p for p in result.parents if len(p) == 2]
    assert merged, "the oracle must include accepted merges"
    assert trainer.archive.merge.total_merges_tested == len(merged)


@pytest.mark.parametrize("budget", [120])
def test_resuming_from_the_archive_keeps_the_trajectory(tmp_path, budget):
    """Stopping and restarting the trainer between iterations changes nothing (state, rng, sampler persist)."""
    seed = {"system_prompt.md": H.SEED_TEXT}
    result, upstream_state = run_upstream(tmp_path / "upstream", seed, budget=budget)
    options = GepaOptions.from_config({
        "trainset": TRAIN, "valset": VAL, "initial_files": seed, "verifier": "reef_gepa.examples.hash_task:verify",
        "feedback": "reef_gepa.examples.hash_task:feedback", "task_model": "reef_gepa.examples.hash_task:task_model",
        "reflection_model": "reef_gepa.examples.hash_task:reflector", "max_metric_calls": budget, "seed": 0})
    tree, release = dict(seed), None
    for step in range(1, 100):
        trainer = GepaTrainer("hash", options, TrainerSetup(data_dir=tmp_path / "reef"))  # a restart per batch
        ctx = TrainContext("hash", step, release, release, None,
                           lambda tree=tree: {k: v.encode() for k, v in tree.items()})
        update = trainer.train(Batch(f"b{step}", [], []), ctx)
        if update is not None:
            release, tree = uuid.uuid4().hex, dict(update.payload)
            trainer.accepted(update, release)
        if trainer.archive.state.total_num_evals >= budget:
            break
    assert_same_run(result, upstream_state, trainer)
