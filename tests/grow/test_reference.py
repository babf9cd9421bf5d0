"""The frozen reference model objectives ask for: the base's log-probs, with LoRA and with full weights."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from reef_core.errors import ConfigError
from reef_core.models.loading import build_tiny_model
from reef_core.grow.objective import Objective, Prepared, sequence_logprobs, token_sum
from reef_core.grow.reference import AdapterBaseReference, SharedBaseReference, reference_cache
from reef_core.grow.token_batch import TokenBatch, TokenDataError, TokenRow, row_from_tokens
from reef_core.grow.torch_backend import TorchTrainer, TorchTrainerOptions

#: Tiny models run fastest single-threaded (intra-op threads mostly wait on each other).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Reinforce(Objective):
    """``-Σ r·logπ / tokens``; records what ``setup`` received."""

    name = "reinforce"

    def loss(self, policy, batch, prepared):
        logp = sequence_logprobs(policy, batch)
        mask = batch.action_mask > 0
        adv = batch.rewards.unsqueeze(1) * batch.action_mask
        return -token_sum(adv * logp, mask) / batch.norm_tokens, {"tokens": float(mask.sum())}


class WithReference(Reinforce):
    needs_reference = True


class OldSetup(Reinforce):
    """An objective written before references existed: its ``setup`` has no ``reference`` keyword."""

    def setup(self, policy, tokenizer, device, *, micro_batches: int = 1) -> None:
        super().setup(policy, tokenizer, device, micro_batches=micro_batches)
        self.set_up = True


class AsksWithOldSetup(OldSetup):
    needs_reference = True


class Loader:
    """``() -> (model, tokenizer)`` of the tiny model with ``seed``, counting its calls."""

    def __init__(self, tok, seed=0):
        self.tok, self.seed, self.calls = tok, seed, 0

    def __call__(self):
        self.calls += 1
        return build_tiny_model(seed=self.seed, tokenizer=self.tok)


def prompt_ids(tok, text):
    return tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def batch(tok, n=3):
    """Rows of different lengths (right padding), rewards of both signs, and a multi-turn row."""
    rows = [row_from_tokens(prompt_ids(tok, f"say {i}"), [40 + i, 41, 42 + i][: 2 + i % 2], [-1.0] * (2 + i % 2),
                            reward=1.0 if i % 2 else -1.0) for i in range(n)]
    first = prompt_ids(tok, "two turns")
    # turn 1 output (50, 51), an observation (60, 61, 62), turn 2 output (52, 53)
    ids = first + [50, 51, 60, 61, 62, 52, 53]
    p = len(first)
    action = [0] * p + [1, 1, 0, 0, 0, 1, 1]
    rows.append(TokenRow(input_ids=ids, action_mask=action, rollout_logprobs=[-1.0 if a else 0.0 for a in action],
                         reward=0.5, response_start=p))
    return TokenBatch.from_rows(rows, pad_token_id=0)


def base_logprobs(model, tb):
    with torch.no_grad():
        return sequence_logprobs(model, tb) * tb.action_mask


def train(trainer, tb, steps=3):
    for _ in range(steps):
        assert trainer.step(tb) is not None


# --------------------------------------------------------------------------- who gets a reference


def test_an_objective_that_does_not_ask_gets_none_and_nothing_is_loaded(tok):
    cached = len(reference_cache)
    for lora in (False, True):
        objective, reference_loader = OldSetup(), Loader(tok)
        trainer = TorchTrainer(objective, Loader(tok),
                               TorchTrainerOptions(lora=lora, lr=1e-2), load_reference_model=reference_loader)
        train(trainer, batch(tok), steps=1)
        assert objective.set_up and objective.reference is None and trainer.reference is None
        # no frozen copy: full weights never call the base loader; a LoRA policy is itself built on the base
        assert reference_loader.calls == (1 if lora else 0)
    assert len(reference_cache) == cached


def test_an_objective_that_asks_needs_a_setup_that_accepts_the_reference(tok):
    trainer = TorchTrainer(AsksWithOldSetup(), Loader(tok))
    with pytest.raises(ConfigError, match="needs_reference.*reference="):
        trainer.load()


def test_from_config_passes_the_deployments_base_loader(tok):
    from reef_core.config.schema import TrainerConfig

    start, base = Loader(tok, seed=1), Loader(tok)
    context = SimpleNamespace(load_base_model=start, load_reference_model=base, device="cpu", seed=0)
    trainer = TorchTrainer.from_config(WithReference(), context, TrainerConfig(), who="test")
    assert trainer._loader is start and trainer._reference_loader is base


# --------------------------------------------------------------------------- LoRA: the adapter-disabled base


def test_lora_reference_is_the_base_under_the_adapter_before_and_after_training(tok):
    objective = WithReference()
    trainer = TorchTrainer(objective, Loader(tok), TorchTrainerOptions(lora=True, lr=5e-2, seed=3))
    tb = batch(tok)
    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    expected = base_logprobs(base, tb)
    reference = trainer.reference  # loads the trainer
    assert isinstance(reference, AdapterBaseReference) and reference is objective.reference
    assert torch.allclose(reference.logprobs(tb), expected, atol=1e-6)
    train(trainer, tb)
    with torch.no_grad():
        moved = sequence_logprobs(trainer.policy, tb) * tb.action_mask
    assert (moved - expected).abs().max() > 1e-3  # the adapter did learn something
    after = reference.logprobs(tb)
    assert torch.allclose(after, expected, atol=1e-6)
    assert not after.requires_grad
    # still adapted once the reference has scored (the adapter is re-enabled on exit)
    with torch.no_grad():
        assert torch.equal(sequence_logprobs(trainer.policy, tb) * tb.action_mask, moved)


def test_lora_reference_holds_no_second_copy_of_the_weights(tok):
    cached = len(reference_cache)
    reference_loader = Loader(tok)
    trainer = TorchTrainer(WithReference(), reference_loader, TorchTrainerOptions(lora=True))
    trainer.load()
    assert trainer.reference.model is trainer.policy
    policy_storage = {p.untyped_storage().data_ptr() for p in trainer.policy.parameters()}
    assert {p.untyped_storage().data_ptr() for p in trainer.reference.model.parameters()} <= policy_storage
    trainer.reference.logprobs(batch(tok))
    assert reference_loader.calls == 1 and len(reference_cache) == cached  # the policy's own load, nothing else


def test_lora_policy_and_reference_use_the_scenarios_base_not_a_later_checkpoint(tok):
    """After a restart the start loader gives the head checkpoint; a LoRA policy restores its adapter over the base."""
    checkpoint, base_loader = Loader(tok, seed=1), Loader(tok, seed=0)
    trainer = TorchTrainer(WithReference(), checkpoint,
                           TorchTrainerOptions(lora=True), load_reference_model=base_loader)
    tb = batch(tok)
    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    assert torch.allclose(trainer.reference.logprobs(tb), base_logprobs(base, tb), atol=1e-6)
    assert checkpoint.calls == 0


# --------------------------------------------------------------------------- full weights: one shared frozen copy


def test_full_reference_is_a_frozen_copy_unchanged_by_training(tok):
    objective = WithReference()
    trainer = TorchTrainer(objective, Loader(tok), TorchTrainerOptions(lr=1e-2))
    tb = batch(tok)
    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    expected = base_logprobs(base, tb)
    reference = trainer.reference  # loads the trainer
    assert isinstance(reference, SharedBaseReference) and reference is objective.reference
    assert not reference.loaded  # the frozen copy is loaded on first use
    assert torch.allclose(reference.logprobs(tb), expected, atol=1e-6)
    frozen = reference.model
    assert frozen is not trainer.policy and not frozen.training
    assert not any(p.requires_grad for p in frozen.parameters())
    train(trainer, tb)
    with torch.no_grad():
        assert ((sequence_logprobs(trainer.policy, tb) * tb.action_mask) - expected).abs().max() > 1e-3
    assert torch.equal(reference.logprobs(tb), reference.logprobs(tb))
    assert torch.allclose(reference.logprobs(tb), expected, atol=1e-6)


def test_full_reference_is_shared_by_trainers_of_the_same_base(tok):
    base_loader = Loader(tok)
    first = TorchTrainer(WithReference(), Loader(tok), TorchTrainerOptions(lr=1e-2), load_reference_model=base_loader)
    second = TorchTrainer(WithReference(), Loader(tok), TorchTrainerOptions(lr=1e-2), load_reference_model=base_loader)
    tb = batch(tok)
    before = second.reference.logprobs(tb)
    first.reference.logprobs(tb)
    assert first.reference.model is second.reference.model
    assert base_loader.calls == 1
    train(first, tb)
    assert torch.equal(second.reference.logprobs(tb), before)
    # another key (another base, or the same one named differently) gets its own copy
    other = TorchTrainer(WithReference(), Loader(tok), load_reference_model=Loader(tok, seed=1))
    other.load()
    assert other.reference.model is not first.reference.model


def test_full_reference_uses_the_base_not_the_start_checkpoint_and_is_freed_with_its_users(tok):
    key = ("test-base", 0)
    checkpoint = Loader(tok, seed=1)
    trainer = TorchTrainer(WithReference(), checkpoint, load_reference_model=Loader(tok), reference_key=key)
    tb = batch(tok)
    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    assert torch.allclose(trainer.reference.logprobs(tb), base_logprobs(base, tb), atol=1e-6)
    assert any(k[0] == key for k in reference_cache.keys())
    del trainer
    gc.collect()
    assert not any(k[0] == key for k in reference_cache.keys())


# --------------------------------------------------------------------------- another prompt (a hinted teacher)


def by_hand(model, prompt, row_ids, row_action):
    """Log-softmax rows of ``row_ids`` from its first action token after ``prompt``, one row alone, placed back at the
    row's positions: ``{t: log-probs of the token at t}`` for its action tokens."""
    first = row_action.index(1)
    seq = list(prompt) + list(row_ids[first:])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    return {t: logp[len(prompt) + t - first - 1] for t in range(first, len(row_ids)) if row_action[t]}


@pytest.mark.parametrize("lora", [False, True])
def test_other_prompts_score_the_same_tokens_realigned_to_the_students_positions(tok, lora):
    trainer = TorchTrainer(WithReference(), Loader(tok), TorchTrainerOptions(lora=lora, lr=1e-2))
    tb = batch(tok)
    train(trainer, tb, steps=1)  # a LoRA policy now carries a non-zero adapter the teacher must not see
    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    hinted = [prompt_ids(tok, f"hint {b}: be brief and kind" if b % 2 else "x") for b in range(tb.size)]
    candidates = torch.randint(0, 512, (*tb.input_ids.shape, 4), generator=torch.Generator().manual_seed(0))
    got = trainer.reference.score(tb, prompts=hinted, token_ids=candidates, top_k=3)
    assert got.logprobs.shape == tb.input_ids.shape and got.token_logprobs.shape == candidates.shape
    assert got.top_k_ids.shape == (*tb.input_ids.shape, 3)
    for b in range(tb.size):
        n = int(tb.attention_mask[b].sum())
        ids, action = tb.input_ids[b, :n].tolist(), [int(a) for a in tb.action_mask[b, :n].tolist()]
        rows = by_hand(base, hinted[b], ids, action)
        for t in range(tb.seq_len):
            if t not in rows:  # prompt, observation and padding positions are 0
                assert got.logprobs[b, t] == 0 and not got.token_logprobs[b, t].any() and not got.top_k_ids[b, t].any()
                continue
            assert torch.allclose(got.logprobs[b, t], rows[t][ids[t]], atol=1e-5), (b, t)
            assert torch.allclose(got.token_logprobs[b, t], rows[t][candidates[b, t]], atol=1e-5), (b, t)
            values, indices = rows[t].topk(3)
            assert torch.equal(got.top_k_ids[b, t], indices), (b, t)
            assert torch.allclose(got.top_k_logprobs[b, t], values, atol=1e-5), (b, t)
    assert torch.equal(trainer.reference.logprobs(tb, prompts=hinted), got.logprobs)
    # the rows' own prompts give the plain scores
    own = [tb.input_ids[b, :int(torch.nonzero(tb.action_mask[b])[0])].tolist() for b in range(tb.size)]
    assert torch.allclose(trainer.reference.logprobs(tb, prompts=own), trainer.reference.logprobs(tb), atol=1e-5)


def test_plain_scores_are_exactly_sequence_logprobs_of_the_base(tok):
    trainer = TorchTrainer(WithReference(), Loader(tok))
    tb = batch(tok)
    scores = trainer.reference.score(tb, token_ids=tb.input_ids.unsqueeze(-1), top_k=1)
    with torch.no_grad():
        expected = sequence_logprobs(trainer.reference.model, tb) * tb.action_mask
    assert torch.equal(scores.logprobs, expected)
    assert torch.equal(scores.token_logprobs.squeeze(-1), expected)  # the sampled token as its own candidate
    assert torch.all(scores.top_k_logprobs.squeeze(-1) >= scores.logprobs)


def test_other_prompts_are_checked(tok):
    trainer = TorchTrainer(WithReference(), Loader(tok), TorchTrainerOptions(lora=True))
    tb = batch(tok)
    with pytest.raises(TokenDataError, match="prompts for a batch"):
        trainer.reference.logprobs(tb, prompts=[[1]])
    with pytest.raises(TokenDataError, match="empty"):
        trainer.reference.logprobs(tb, prompts=[[1]] * (tb.size - 1) + [[]])
    with pytest.raises(TokenDataError, match="token_ids"):
        trainer.reference.score(tb, token_ids=tb.input_ids)
    with pytest.raises(TokenDataError, match="top_k"):
        trainer.reference.score(tb, top_k=-1)


def test_lora_restart_restores_the_adapter_over_the_base_once(tok):
    """A restarted learner's start loader gives base + adapter merged (the head); the LoRA policy must not apply the
    adapter twice, and its reference stays the base."""
    from reef_core.grow.trainer import TrainContext
    from reef_core.surfaces.weights import state_dict_from_files

    base_loader = Loader(tok)
    before = TorchTrainer(WithReference(), base_loader, TorchTrainerOptions(lora=True, lr=5e-2, seed=3))
    tb = batch(tok)
    train(before, tb)
    files = dict(before._files(before._payload()))

    def head_checkpoint():  # what the learner's start loader builds from the head release
        model, tokenizer = base_loader()
        model.load_state_dict(state_dict_from_files(files, base_loader), strict=False)
        return model, tokenizer

    after = TorchTrainer(WithReference(), head_checkpoint,
                         TorchTrainerOptions(lora=True, seed=3), load_reference_model=base_loader)
    after._sync(TrainContext(scenario="s", step=4, serving_release_id="r3", serving_version="x:3",
                             algorithm_state=None, current_files=lambda: files))
    with torch.no_grad():
        expected = sequence_logprobs(before.policy, tb) * tb.action_mask
        assert torch.allclose(sequence_logprobs(after.policy, tb) * tb.action_mask, expected, atol=1e-5)
    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    assert torch.allclose(after.reference.logprobs(tb), base_logprobs(base, tb), atol=1e-6)


def test_full_rollback_to_the_creation_release_restores_the_scenarios_base_not_the_start_checkpoint(tok):
    trainer = TorchTrainer(Reinforce(), Loader(tok, seed=1), load_reference_model=Loader(tok))
    trainer.load()
    trainer._expected_release = "r2"  # the trainer serves a later release; the head goes back to release 0
    trainer._load_release("r0", {"base.json": b'{"model": "tiny", "digest": "sha256:0"}'})
    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    tb = batch(tok)
    with torch.no_grad():
        assert torch.allclose(sequence_logprobs(trainer.policy, tb) * tb.action_mask, base_logprobs(base, tb),
                              atol=1e-6)


def test_a_learner_hands_its_trainer_the_deployments_base_as_the_reference(tmp_path):
    """The start loader may give the head checkpoint; the reference loader is the serving ports' plain base."""
    from reef_core.config.schema import EvaluationConfig, RecipeConfig, TrainerConfig
    from reef_core.loop.learner import ScenarioLearner
    from reef_core.loop.ports import LearnerPorts, LearnerSettings, ServingPorts

    def base():
        raise AssertionError("not loaded by building the trainer")

    serving = ServingPorts(engine=None, artifacts=None, run_async=None, load_base_model=base)
    contexts = []

    def create(kind, name, **kwargs):
        contexts.append(kwargs["context"])
        return SimpleNamespace()

    ports = LearnerPorts(serving=serving, records=None, create=create, notify=None, pool=None)
    settings = LearnerSettings(data_dir=tmp_path, seed=0, trainer=TrainerConfig(), evaluation=EvaluationConfig())
    learner = ScenarioLearner("s", RecipeConfig(name="t", trainer="torch"), None, ports, settings)
    assert learner.trainer is not None
    (context,) = contexts
    assert context.load_reference_model is base and context.load_base_model == learner._load_start_model
