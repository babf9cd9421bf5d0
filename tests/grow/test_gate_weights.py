"""The evaluation gate for weight candidates: the trainer's private evaluation engine, evaluation tasks from config,
held-out records and the replay evaluator (issue #14 item 3)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
import torch

from reef_core.commit.gate import Candidate, Current
from reef_core.commit.policies import score_comparison
from reef_core.config import compose_config
from reef_core.engines.base import EngineRequest
from reef_core.engines.local import LocalEngine
from reef_core.errors import ConfigError
from reef_core.grow.eval_engine import EvalGeneration
from reef_core.models.loading import ensure_tiny_model, load_model
from reef_core.grow.objective import Objective
from reef_core.grow.torch_backend import TorchTrainer, TorchTrainerOptions
from reef_core.loop.assemble import build_deployment
from reef_core.observe.model import Record
from reef_core.observe.processors import PerReportProcessor
from reef_core.observe.processors.per_report import in_holdout
from reef_core.plugins import PluginManager
from reef_core.testing.steering import steer

#: Tiny models run fastest single-threaded (intra-op threads mostly wait on each other).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TASK = {"id": "t1", "messages": [{"role": "user", "content": "Reply using only the letters a, e, i, o, u."}],
        "alphabet": "aeiou"}


class Unused(Objective):
    """The evaluation tests never train."""

    name = "unused"

    def prepare(self, policy, batch):
        raise AssertionError("not trained here")

    def loss(self, policy, batch, prepared):
        raise AssertionError("not trained here")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def trainer_for(model_dir: Path, **generation) -> TorchTrainer:
    return TorchTrainer(Unused(), lambda: load_model(model_dir),
                        TorchTrainerOptions(device="cpu", eval_model_dir=model_dir, eval_max_new_tokens=8,
                                            eval_generation=EvalGeneration(**generation)))


def steered_payload(model_dir: Path, letters: str) -> dict:
    model, tok = load_model(model_dir)
    steer(model, tok, letters)
    return {k: v.clone() for k, v in model.state_dict().items()}


def fingerprint(model) -> str:
    digest = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_run_task_generates_with_the_subjects_weights_and_never_touches_serving(model_dir):
    loop = asyncio.new_event_loop()
    serving = LocalEngine(model_dir, device="cpu", max_new_tokens=8, version="srv:1")
    loop.run_until_complete(serving.start())
    try:
        def served() -> str:
            body = {"messages": TASK["messages"], "temperature": 0, "max_tokens": 8}
            response = loop.run_until_complete(serving.complete(EngineRequest("openai", "chat", body)))
            return response.body["choices"][0]["message"]["content"]

        before = (serving.version, fingerprint(serving._model), served())
        trainer = trainer_for(model_dir)
        candidate = Candidate("s:1", "s", "rel-0", payload=steered_payload(model_dir, "ae"))
        current = Current("s", "rel-0")

        assert trainer.run_task(current, TASK) == before[2]  # the snapshot: the weights that serve
        reply = trainer.run_task(candidate, TASK)
        assert reply and set(reply) <= {"a", "e"}  # the candidate's own weights
        assert trainer.run_task(current, TASK) == before[2]  # and back
        engine = trainer._eval_engine
        loads = engine.loads
        assert trainer.run_task(current, TASK) == before[2]
        assert engine.loads == loads  # the same subject again: no reload

        assert (serving.version, fingerprint(serving._model), served()) == before
        assert engine._engine is not serving and engine._engine.version == "eval"

        # After an accepted step the snapshot moves: Current now answers with the accepted weights.
        with torch.no_grad():
            trainer.policy.load_state_dict(candidate.payload, strict=False)
        trainer.accepted(None, "rel-1")
        assert trainer.run_task(Current("s", "rel-1"), TASK) == reply
    finally:
        loop.run_until_complete(serving.close())
        loop.close()
        if "trainer" in locals() and trainer._eval_engine is not None:
            trainer._eval_engine.close()


def test_the_gate_compares_candidate_and_current_on_tasks(model_dir):
    pm = PluginManager()
    trainer = trainer_for(model_dir, temperature=1.0, seed=3)
    tasks = [dict(TASK, id=f"t{i}", messages=[{"role": "user", "content": f"Task {i}: only vowels please"}])
             for i in range(4)]
    evaluator = pm.create("evaluator", "python", tasks=tasks, run=trainer.run_task,
                          options={"path": "reef_sao.tasks:verify_letter_share"})
    try:
        better = evaluator.evaluate(Candidate("s:1", "s", "r0", payload=steered_payload(model_dir, "ae")))
        worse = evaluator.evaluate(Candidate("s:2", "s", "r0", payload=steered_payload(model_dir, "zx")))
        again = evaluator.evaluate(Candidate("s:3", "s", "r0", payload=steered_payload(model_dir, "zx")))
    finally:
        trainer._eval_engine.close()
    assert better.scores == [1.0] * 4 and worse.scores == [0.0] * 4
    assert better.baseline_scores == worse.baseline_scores == again.baseline_scores  # seeded: repeatable
    assert all(0 < b < 1 for b in better.baseline_scores)
    assert score_comparison().decide(None, better).selected
    assert not score_comparison().decide(None, worse).selected


def test_run_task_without_a_local_model_directory_is_a_config_error(model_dir):
    trainer = TorchTrainer(Unused(), lambda: load_model(model_dir), TorchTrainerOptions(device="cpu"))
    with pytest.raises(ConfigError, match="engine.kind=local"):
        trainer.run_task(Current("s", None), TASK)


# -- evaluation tasks from config -------------------------------------------------------------------------------------


def test_evaluation_tasks_are_checked_at_start(tmp_path):
    def build(*overrides):
        cfg = compose_config(["engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                              f"storage.data_dir={tmp_path / 'data'}", *overrides])
        return build_deployment(cfg)

    with pytest.raises(ConfigError, match=r"evaluation.tasks .*is not a file"):
        build(f"evaluation.tasks={tmp_path / 'missing.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ConfigError, match=r"evaluation.tasks: bad.jsonl line 2"):
        build(f"evaluation.tasks={bad}")
    with pytest.raises(ConfigError, match="evaluation.tasks 'pkg://no_such_package/x.jsonl'"):
        build("evaluation.tasks=pkg://no_such_package/x.jsonl")
    dep = build("evaluation.tasks=pkg://reef_sao/data/vowels.jsonl")
    dep.store.close()
    with pytest.raises(ConfigError, match="evaluation.options.generation.temperature"):
        build("+evaluation.options.generation.temperature=-1")
    with pytest.raises(ConfigError, match="evaluation.options.generation has unknown keys"):
        build("+evaluation.options.generation.top_p=0.5")
    # A routed recipe's own evaluation section is checked as well.
    missing = tmp_path / "routed.jsonl"
    with pytest.raises(ConfigError, match=r"evaluation.tasks of recipe 'sao' .*routed.jsonl' is not a file"):
        build(f"routes=[{{pattern: 'm-*', recipe: sao, overrides: ['evaluation.tasks={missing}']}}]")


def test_the_learner_hands_config_tasks_or_held_out_records_to_the_evaluator():
    from types import SimpleNamespace

    from reef_core.grow.trainer import CandidateUpdate
    from reef_core.loop.learner import ScenarioLearner

    update = CandidateUpdate(files={}, eval_tasks=[{"id": "own"}])
    learner = ScenarioLearner.__new__(ScenarioLearner)  # only the task choice is exercised
    learner.processor = SimpleNamespace(replay_tasks=lambda: [{"id": "held"}])
    learner.settings = SimpleNamespace(evaluation=SimpleNamespace(evaluator="python"))
    learner.eval_tasks = None
    assert learner._evaluation_tasks(update) == [{"id": "own"}]
    learner.eval_tasks = [{"id": "file"}]
    assert learner._evaluation_tasks(update) == [{"id": "file"}]
    learner.settings.evaluation.evaluator = "replay"
    assert learner._evaluation_tasks(update) == [{"id": "held"}]


# -- hold-out and replay ----------------------------------------------------------------------------------------------


def records(n: int) -> list[Record]:
    out, seq = [], 0
    for i in range(n):
        seq += 1
        messages = [{"role": "user", "content": f"q{i}"}]
        payload = {"route": "chat", "dialect": "openai", "client_dialect": "openai", "stream": False,
                   "request": {"model": "m", "messages": messages},
                   "response": {"object": "chat.completion",
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"a{i}"}}]},
                   "engine": "test", "timings": {}}
        out.append(Record(record_id=f"inf-{i}", scenario="s", kind="inference", payload=payload, version="inc:1",
                          sequence=seq))
        seq += 1
        out.append(Record(record_id=f"rep-{i}", scenario="s", kind="report",
                          payload={"score": i / n, "metadata": {"expected": f"a{i}"}},
                          references=[f"inf-{i}"], sequence=seq))
    return out


def drain(processor) -> list[str]:
    trained = []
    while (batch := processor.pending_batch()) is not None:
        trained += processor.acknowledge(batch.batch_id)
    return trained


def test_held_out_records_never_train_and_restarts_hold_out_the_same():
    stream = records(40)
    first = PerReportProcessor("s", batch_size=2, holdout=0.3, max_replay_tasks=100)
    for record in stream:
        first.ingest(record)
    trained = drain(first)
    held = {f"inf-{i}" for i in range(40) if in_holdout(f"inf-{i}", 0.3)}
    assert 4 <= len(held) <= 20  # the hash spreads ids roughly by the fraction
    assert not held & set(trained)
    tasks = first.replay_tasks()
    assert {t["id"] for t in tasks} == {i.replace("inf", "rep") for i in held}
    task = tasks[0]
    i = int(task["id"].split("-")[1])
    assert task == {"id": f"rep-{i}", "input": [{"role": "user", "content": f"q{i}"}], "reported_score": i / 40,
                    "metadata": {"expected": f"a{i}"}}
    assert first.status()["held_out"] == len(held) and first.status()["replay_tasks"] == len(held)

    # A restart replays the records that never trained: the same ones are held out again.
    again = PerReportProcessor("s", batch_size=2, holdout=0.3, max_replay_tasks=100)
    again.restore(set(trained))
    for record in stream:
        again.ingest(record)
    assert drain(again) == []
    assert again.replay_tasks() == tasks

    bounded = PerReportProcessor("s", batch_size=2, holdout=0.3, max_replay_tasks=2)
    for record in stream:
        bounded.ingest(record)
    assert bounded.replay_tasks() == tasks[-2:]  # the newest


def test_holdout_options_are_validated():
    from reef_core.builtins.processors import make_per_report

    for bad in ({"holdout": 1.0}, {"holdout": -0.1}, {"holdout": "x"}, {"max_replay_tasks": 0}):
        with pytest.raises(ConfigError):
            make_per_report(scenario="s", options=bad)
    assert make_per_report(scenario="s", options={"holdout": 0.1}).holdout == 0.1


def test_replay_runs_the_candidate_on_held_out_prompts_against_reported_scores(model_dir):
    pm = PluginManager()
    processor = PerReportProcessor("s", batch_size=1, holdout=0.5)
    for record in records(12):
        processor.ingest(record)
    tasks = processor.replay_tasks()
    assert tasks
    with pytest.raises(ConfigError, match="evaluation.options.evaluator.scorer"):
        pm.create("evaluator", "replay", tasks=tasks, run=lambda s, t: "", options={})
    trainer = trainer_for(model_dir)
    evaluator = pm.create("evaluator", "replay", tasks=tasks, run=trainer.run_task,
                          options={"scorer": "regex", "pattern": "^[ae]+$"})
    try:
        result = evaluator.evaluate(Candidate("s:1", "s", "r0", payload=steered_payload(model_dir, "ae")))
    finally:
        trainer._eval_engine.close()
    assert result.scores == [1.0] * len(tasks)
    assert result.baseline_scores == [t["reported_score"] for t in tasks]
    assert result.metadata["task_ids"] == [t["id"] for t in tasks]
    assert json.dumps(result.to_dict())


def test_lora_current_is_the_snapshot_adapter(model_dir):
    trainer = TorchTrainer(Unused(), lambda: load_model(model_dir),
                           TorchTrainerOptions(device="cpu", lora=True, lora_rank=4, eval_model_dir=model_dir,
                                               eval_max_new_tokens=8))
    try:
        base_reply = trainer.run_task(Current("s", None), TASK)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a trained adapter, as a step would leave it
            for name, param in trainer.policy.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 2.0)
        candidate = Candidate("s:1", "s", None, payload=trainer._payload())
        reply = trainer.run_task(candidate, TASK)
        assert reply != base_reply
        assert trainer.run_task(Current("s", None), TASK) == base_reply  # the snapshot, not the live adapter
        trainer.accepted(None, "rel-1")
        assert trainer.run_task(Current("s", "rel-1"), TASK) == reply
    finally:
        if trainer._eval_engine is not None:
            trainer._eval_engine.close()
