"""The ``gepa`` trainer on the learnable example task: traffic minibatches, the gate, publication through
the real release store and harness surface, budgets, options and the served model."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from reef_core.testing import (
    CommitLog,
    Committer,
    GitArtifactStore,
    HarnessSurface,
    PluginManager,
    run_gate,
    serve_asgi,
)
from reef_core.api import (
    Batch,
    Candidate,
    ConfigError,
    Current,
    EngineChat,
    Sample,
    Segment,
    TrainContext,
    TrainerSetup,
    UpstreamEngine,
    ValidationFailed,
    inject_system,
    render_system_prompt,
)
from reef_gepa import examples as E
from reef_gepa.examples.standins import chat_app
from reef_gepa.options import GepaOptions
from reef_gepa.trainer import GepaTrainer

PM = PluginManager()


def options(**overrides) -> GepaOptions:
    base = {"valset": {"path": "reef_gepa.examples:tasks", "kwargs": {"split": "val"}},
            "verifier": "reef_gepa.examples:verify", "feedback": "reef_gepa.examples:feedback",
            "task_model": "reef_gepa.examples:task_model", "reflection_model": "reef_gepa.examples:reflector",
            "initial_files": {"system_prompt.md": E.SEED_PROMPT, "README.md": "Not part of the prompt."}, "seed": 0}
    return GepaOptions.from_config({**base, **overrides})


class Client:
    """Runs training tasks with the served tree the way an agent behind Reef would, and reports them."""

    def __init__(self, scenario="facts"):
        self.scenario = scenario
        self.train = E.train_tasks()
        self.cursor = 0

    def batch(self, tree, n=3) -> Batch:
        samples = []
        for _ in range(n):
            task = self.train[self.cursor % len(self.train)]
            self.cursor += 1
            body = inject_system("openai", {"messages": [{"role": "user", "content": task["input"]}]},
                                 render_system_prompt(tree), "extend")
            answer = E.task_model(body["messages"])
            score = E.verify(answer, task)
            rid = uuid.uuid4().hex
            samples.append(Sample(self.scenario, [*body["messages"], {"role": "assistant", "content": answer}],
                                  [Segment(len(body["messages"]), rid, None)], reward=score,
                                  feedback=E.feedback(task, answer, score), metadata={"task": task},
                                  source_ids=[rid, "r" + rid], report_id="r" + rid))
        return Batch(uuid.uuid4().hex, samples, [x for s in samples for x in s.source_ids], self.scenario)


def gate(trainer, update, release, policy="score_comparison", **policy_options):
    evaluator = PM.create("evaluator", "python", tasks=update.eval_tasks, run=trainer.run_task,
                          options={"path": "reef_gepa.examples:verify"})
    candidate = Candidate(uuid.uuid4().hex, "facts", release, None, update.payload)
    return run_gate(evaluator, PM.create("selection_policy", policy, **policy_options), candidate)


def ctx_for(step, release, tree):
    return TrainContext("facts", step, release, release, None, lambda: {k: v.encode() for k, v in tree.items()})


def test_traffic_minibatches_improve_the_prompt_release_by_release(tmp_path):
    trainer = GepaTrainer("facts", options(), TrainerSetup(data_dir=tmp_path))
    client = Client()
    tree = {k: v for k, v in trainer.options.initial_files.items()}
    release, published = None, []
    for step in range(1, 9):
        update = trainer.train(client.batch(tree), ctx_for(step, release, tree))
        if update is None:
            continue
        # The parent was the served tree and the minibatch its own traffic: no episode was re-run for it.
        assert update.metrics["episodes_reused"] == 3
        assert update.metrics["minibatch_after"] > update.metrics["minibatch_before"]
        decision = gate(trainer, update, release)
        assert decision.selected, decision.reason
        release, tree = uuid.uuid4().hex, dict(update.payload)
        trainer.accepted(update, release)
        published.append(E.score_prompt(render_system_prompt(tree), E.val_tasks()))
        assert tree["README.md"] == "Not part of the prompt."  # non-component files ride along unchanged
    assert published == [0.25, 0.5, 0.75, 1.0]  # one fact per accepted round, each release better
    summary = trainer.status()
    assert summary["served"] == summary["best"] == 4
    assert all(fact in tree["system_prompt.md"] for fact in E.FACTS.values())


def test_served_tree_is_the_minibatch_parent_only_when_it_is_the_parent(tmp_path):
    """Traffic produced by another prompt is re-run, never mistaken for the parent's own answers."""
    trainer = GepaTrainer("facts", options(), TrainerSetup(data_dir=tmp_path))
    seed = dict(trainer.options.initial_files)
    foreign = {**seed, "system_prompt.md": "Some other prompt."}
    update = trainer.train(Client().batch(foreign), ctx_for(1, None, seed))
    assert update is not None and update.metrics["episodes_reused"] == 0


def test_rejected_candidate_leaves_the_served_tree_unchanged(tmp_path):
    """Library level: git release store + commit log + harness surface + gate, wired as the learner does."""
    store = GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "work")
    committer = Committer(store, CommitLog.for_scenario(tmp_path / "commits", "facts"), "facts")
    surface = HarnessSurface(None, {"inject": "system"})
    trainer = GepaTrainer("facts", options(), TrainerSetup(data_dir=tmp_path / "data"))
    head, _ = committer.publish(trainer.initial_files(), expected_head=None, operation="creation")
    surface.activate("facts", head.release_id, files=lambda: store.read_files(head.release_id))
    served_before = dict(surface.current("facts").files)
    client = Client()

    update = trainer.train(client.batch(served_before), ctx_for(2, head.release_id, served_before))
    assert update is not None and update.metrics["val_mean"] > update.metrics["served_val_mean"]
    decision = gate(trainer, update, head.release_id, "floor", floor_score=1.0)  # the candidate scores 0.25
    assert not decision.selected
    trainer.rejected(update)
    committer.record_rejection(consumed_ids=["r1"], metrics=update.metrics, decision=decision.to_dict())

    assert store.head("facts").release_id == head.release_id
    assert surface.serving_version("facts") == head.release_id
    assert surface.current("facts").files == served_before
    body, shaped_by = surface.prepare_request("facts", "anthropic", {"max_tokens": 5, "messages": []})
    assert shaped_by == head.release_id and body["system"] == E.SEED_PROMPT
    assert trainer.archive.size == 2 and trainer.archive.served == 0  # kept on its fronts, not served

    # The next candidate passes the gate: published, activated, served.
    update = trainer.train(client.batch(served_before), ctx_for(3, head.release_id, served_before))
    assert update is not None
    decision = gate(trainer, update, head.release_id)
    assert decision.selected
    release, _ = committer.publish(update.files, expected_head=head.release_id, decision=decision.to_dict())
    surface.activate("facts", release.release_id, payload=update.payload)
    trainer.accepted(update, release.release_id)
    assert surface.system_text("facts") == update.payload["system_prompt.md"] != E.SEED_PROMPT
    assert store.read_files(release.release_id)["system_prompt.md"].decode() == update.payload["system_prompt.md"]


def test_run_task_for_candidate_and_current(tmp_path):
    trainer = GepaTrainer("facts", options(), TrainerSetup(data_dir=tmp_path))
    seed = dict(trainer.options.initial_files)
    trainer.train(Client().batch(seed), ctx_for(1, "rel-1", seed))
    task = next(t for t in E.val_tasks() if t["category"] == "alpha")
    assert trainer.run_task(Current("facts", "rel-1"), task).startswith("I do not know")
    assert trainer.run_task(Current("facts", None), task).startswith("I do not know")  # the initial files
    better = {"system_prompt.md": E.SEED_PROMPT + "\n" + E.FACTS["alpha"]}
    assert trainer.run_task(Candidate("c", "facts", "rel-1", payload=better), task) == task["answer"]
    with pytest.raises(ValidationFailed):
        trainer.run_task(Current("facts", "never-seen"), task)


def test_budget_stops_the_search(tmp_path):
    calls = {"n": 0}

    def counting_reflector(messages):
        calls["n"] += 1
        return E.reflector(messages)

    trainer = GepaTrainer("facts", options(max_metric_calls=30), TrainerSetup(data_dir=tmp_path),
                          reflection_model=counting_reflector)
    seed = dict(trainer.options.initial_files)
    client = Client()
    trainer.train(client.batch(seed), ctx_for(1, None, seed))  # 24 (seed validation) + 6 (one iteration)
    assert trainer.status()["metric_calls"] >= 30 and calls["n"] == 1
    for step in range(2, 5):
        assert trainer.train(client.batch(seed), ctx_for(step, None, seed)) is None
    assert calls["n"] == 1 and trainer.status()["iterations"] == 1


def test_operator_edit_becomes_a_parentless_candidate(tmp_path):
    trainer = GepaTrainer("facts", options(), TrainerSetup(data_dir=tmp_path))
    seed = dict(trainer.options.initial_files)
    trainer.train(Client().batch(seed), ctx_for(1, "a", seed))
    edited = {**seed, "system_prompt.md": E.SEED_PROMPT + "\n" + E.FACTS["beta"] + "\n" + E.FACTS["gamma"]}
    trainer.train(Client().batch(edited), ctx_for(2, "b", edited))
    state = trainer.archive.state
    idx = trainer.archive.find({"system_prompt.md": edited["system_prompt.md"]})
    assert idx is not None and state.parent_program_for_candidate[idx] == []
    assert trainer.archive.releases["b"] == idx


@pytest.mark.parametrize("bad, needle", [
    ({"verifier": None}, "verifier"), ({"valset": None}, "valset"), ({"components": []}, "components"),
    ({"minibatch-size": 0}, "minibatch_size"), ({"bogus": 1}, "unknown option"), ({"components": ["../x"]}, "'..'"),
    ({"frontier_type": "objective"}, "frontier_type"), ({"candidate_selection_strategy": "best"}, "selection"),
    ({"reflection_prompt_template": "no placeholders"}, "placeholder"), ({"valset": []}, "empty"),
    ({"valset": [{"id": 1, "input": "a"}, {"id": 1, "input": "b"}]}, "unique"),
])
def test_options_are_validated(tmp_path, bad, needle):
    with pytest.raises(ConfigError, match=needle):
        GepaTrainer("facts", options(**bad), TrainerSetup(data_dir=tmp_path))


def test_served_model_through_the_engine_from_a_worker_thread():
    """``task_model: null`` runs on the deployment's engine; the server's own loop is never borrowed."""
    app = chat_app(E.task_model)
    messages = [{"role": "system", "content": E.FACTS["delta"]}, {"role": "user", "content": "[delta] item 3?"}]
    with serve_asgi(app) as url:
        engine = UpstreamEngine(url)
        server_loop = asyncio.new_event_loop()
        thread = threading.Thread(target=server_loop.run_forever, daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(engine.start(), server_loop).result(10)
            assert EngineChat(engine)(messages) == "DEL-3"  # a twin engine on a private loop
            run_async = lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, server_loop).result(10)  # noqa: E731
            assert EngineChat(engine, run_async)(messages) == "DEL-3"  # the deployment's loop, when offered
            assert app.state.calls == 2
        finally:
            asyncio.run_coroutine_threadsafe(engine.close(), server_loop).result(10)
            server_loop.call_soon_threadsafe(server_loop.stop)
            thread.join(5)


def test_an_instruction_is_reflection_input_and_needs_no_traffic(tmp_path):
    """A person's instruction (``POST /reef/train``) reaches the reflection prompt beside the feedback; without reported
    traffic its minibatch is the valset. A batch with neither trains nothing."""
    seen = []

    def reflector(messages):
        seen.append(str(messages))
        return E.reflector(messages)

    trainer = GepaTrainer("facts", options(), TrainerSetup(data_dir=tmp_path), reflection_model=reflector)
    tree = dict(trainer.options.initial_files)
    assert trainer.train(Batch("empty", [], [], "facts"), ctx_for(1, None, tree)) is None and not seen
    text = f"Remember this: {E.FACTS[E.CATEGORIES[-1]]}"
    batch = Batch("facts:instruction:i1", [], ["i1"], "facts",
                  instructions=[{"agent_record_id": "i1", "text": text}])
    update = trainer.train(batch, ctx_for(2, None, tree))
    assert seen and all(f"Instruction from a person: {text}" in prompt for prompt in seen)
    assert update is not None and update.metrics["minibatch_after"] > update.metrics["minibatch_before"]
