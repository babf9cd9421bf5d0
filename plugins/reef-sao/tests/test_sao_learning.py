"""SAO learns the example task at library level (no HTTP): tiny random-init model, real records, real processor.

Rollouts are sampled with torch the way the local engine samples them (token ids + raw temperature-1 log-probs),
stored as inference records, scored by the example's verifier and reported; the real ``per_report`` processor
turns records into batches and the ``sao`` trainer (built by its registered factory) takes one optimizer step per
batch, whose payload then "serves" the next rollouts. Acceptance (recipe reference §3.5): over 480 rollouts,
``mean(last 48) >= 0.2`` and ``mean(last 48) - mean(first 48) >= 0.1`` on a fixed seed.
"""

from __future__ import annotations

import itertools
import statistics
import time

import pytest
import torch

from reef_core.api import (
    Record,
    RecipeConfig,
    TrainContext,
    TrainerConfig,
    TrainerSetup,
    build_tiny_model,
    build_tiny_tokenizer,
)
from reef_core.testing import PluginManager
from reef_sao.rollouts import sample_rollouts
from reef_sao.schema import validate_sao_report
from reef_sao.tasks import score, task_stream

#: Tiny models run fastest single-threaded (intra-op threads mostly wait on each other).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROLLOUTS = 480
WINDOW = 48


class Stream:
    """Stores records with gap-free sequences, as the record store does."""

    def __init__(self, scenario: str):
        self.scenario = scenario
        self.seq = itertools.count(1)

    def inference(self, task, rollout, version: str) -> Record:
        rid = f"inf-{task.task_id}"
        payload = {"route": "chat", "dialect": "openai", "request": {"messages": task.messages()},
                   "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": rollout.text},
                                             "finish_reason": "stop"}]},
                   "tokens": rollout.tokens(version)}
        return Record(record_id=rid, scenario=self.scenario, kind="inference", payload=payload, version=version,
                      sequence=next(self.seq))

    def report(self, inference: Record, value: float) -> Record:
        body = validate_sao_report({"score": value, "references": [inference.record_id]})
        return Record(record_id=f"rep-{inference.record_id}", scenario=self.scenario, kind="report",
                      payload={"score": body["score"]}, references=body["references"], sequence=next(self.seq))


def run_stream(*, recipe: dict, trainer_section: dict, processor: str, processor_options: dict,
               chats_per_prompt: int = 1, seed: int = 0):
    tok = build_tiny_tokenizer()
    pm = PluginManager()
    setup = TrainerSetup(data_dir=None, load_base_model=lambda: build_tiny_model(seed=seed, tokenizer=tok), seed=seed)
    trainer = pm.create("trainer", "sao", scenario="demo",
                        recipe=RecipeConfig(options=recipe["options"], processor_options=processor_options),
                        trainer=TrainerConfig(**trainer_section), context=setup)
    serving = {"version": "base", "seq": 0}
    proc = pm.create("processor", processor, scenario="demo", options=processor_options,
                     serving_version=lambda: serving["version"])
    stream, tasks = Stream("demo"), task_stream(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    batch_size = recipe["options"]["batch_size"]
    rewards: list[float] = []
    metrics: list[dict] = []
    while len(rewards) < ROLLOUTS:
        # One batch worth of rollouts from the serving weights (the trainer's policy after each accepted step).
        prompts = [next(tasks) for _ in range(batch_size // chats_per_prompt)]
        batch_tasks = [t for t in prompts for _ in range(chats_per_prompt)]
        rolls = sample_rollouts(trainer.policy, trainer.tokenizer, [t.messages() for t in batch_tasks],
                                max_new_tokens=8, generator=gen)
        for i, (task, rollout) in enumerate(zip(batch_tasks, rolls)):
            task = task.__class__(f"{task.task_id}-{i}", task.prompt, task.alphabet)
            value = score(task, rollout.text)
            rewards.append(value)
            inference = stream.inference(task, rollout, serving["version"])
            proc.ingest(inference)
            proc.ingest(stream.report(inference, value))
        while proc.ready():
            batch = proc.pending_batch()
            ctx = TrainContext(scenario="demo", step=serving["seq"] + 1, serving_release_id=None,
                               serving_version=serving["version"], algorithm_state=None)
            update = trainer.train(batch, ctx)
            assert update is not None
            trainer.accepted(update, None)
            proc.acknowledge(batch.batch_id)
            serving["seq"] += 1
            serving["version"] = f"base:{serving['seq']}"
            metrics.append(update.metrics)
    return rewards, metrics, proc.status()


def assert_learned(rewards):
    first, last = statistics.mean(rewards[:WINDOW]), statistics.mean(rewards[-WINDOW:])
    assert last >= 0.2 and last - first >= 0.1, f"no learning: first {first:.3f}, last {last:.3f}"
    return first, last


def test_sao_learns_the_vowel_task_from_single_scored_rollouts():
    started = time.monotonic()
    rewards, metrics, status = run_stream(
        recipe={"options": {"batch_size": 8, "eps_clip": 0.3, "eps_clip_high": 5.0, "critic_steps_per_actor": 2,
                            "lambda_alpha": 1.5}},
        trainer_section={"backend": "torch", "lr": 1e-2, "critic_lr": 1e-2, "grad_accumulation": 1,
                         "device": "cpu"},
        processor="per_report", processor_options={"batch_size": 8, "max_staleness": 0})
    first, last = assert_learned(rewards)
    assert len(metrics) == ROLLOUTS // 8  # one optimizer step per batch, every batch accepted
    assert status["dropped"] == {} and status["samples_acknowledged"] == ROLLOUTS
    final = metrics[-1]
    for key in ("pg_clipfrac", "critic/explained_variance", "grad_norm", "sao/policy_lag_max", "loss"):
        assert key in final, key
    assert final["sao/policy_lag_max"] == 0  # every batch trained on the version that produced it
    # explained variance is reported while returns vary (None once every reward is equal: nothing to explain)
    assert any(m["critic/explained_variance"] is not None for m in metrics[:10])
    # the critic tracks the return: its mean value follows the batch's mean reward by the end of the run
    tail = metrics[-5:]
    assert abs(statistics.mean(m["critic/value_mean"] for m in tail)
               - statistics.mean(m["reward_mean"] for m in tail)) < 0.15
    print(f"sao: first {first:.3f} -> last {last:.3f} in {time.monotonic() - started:.1f}s")


def test_grpo_control_arm_learns_with_groups_of_four():
    rewards, metrics, status = run_stream(
        recipe={"options": {"advantage": "grpo", "batch_size": 8, "group_size": 4, "eps_clip": 0.3,
                            "eps_clip_high": 5.0}},
        trainer_section={"backend": "torch", "lr": 1e-2, "grad_accumulation": 2, "device": "cpu"},
        processor="grouped",
        processor_options={"group_size": 4, "key": "prompt", "groups_per_batch": 2, "max_staleness": 0},
        chats_per_prompt=4)
    assert_learned(rewards)
    assert all(m["grpo/groups"] == 2 for m in metrics)  # the processor's prompt groups reached the objective
