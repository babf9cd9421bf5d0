"""Token batches, the objective contract and the torch trainer backend, on the real tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load as load_safetensors

from reef_core.models.adapter import AdapterWeights
from reef_core.errors import ConfigError, ValidationFailed
from reef_core.models.loading import build_tiny_model
from reef_core.grow.objective import Objective, Prepared, ValueModel, sequence_logprobs, token_sum
from reef_core.grow.token_batch import TokenBatch, TokenDataError, row_from_sample, row_from_tokens
from reef_core.grow.torch_backend import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MODEL_FILE,
    TorchTrainer,
    TorchTrainerOptions,
    policy_lag,
)
from reef_core.grow.trainer import TrainContext
from reef_core.observe.processor import Batch, Sample, Segment

#: Tiny models run fastest single-threaded (intra-op threads mostly wait on each other).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Reinforce(Objective):
    """A minimal objective: ``-Σ A·logπ / tokens`` with the sample reward as advantage on every action token."""

    name = "reinforce"

    def prepare(self, policy, batch):
        adv = batch.rewards.unsqueeze(1) * batch.action_mask
        return Prepared(batch=batch.with_extras(advantages=adv))

    def loss(self, policy, batch, prepared):
        logp = sequence_logprobs(policy, batch)
        mask = batch.action_mask > 0
        loss = -token_sum(batch.extras["advantages"] * logp, mask) / batch.norm_tokens
        return loss, {"tokens": float(mask.sum())}


def loader(tok, seed=0):
    return lambda: build_tiny_model(seed=seed, tokenizer=tok)


def rows(tok, n=4, seed=0):
    """``n`` single-turn rows with real rollout log-probs from the seed-0 tiny model."""
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        text = f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n"
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        ids, lps = list(prompt), []
        with torch.no_grad():
            for _ in range(3 + i % 3):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                lps.append(float(torch.log_softmax(logits, -1)[t]))
                ids.append(t)
        out.append(row_from_tokens(prompt, ids[len(prompt):], lps, reward=float(i % 2) - 0.3, version="base:0"))
    return out


def sample(tokens_per_turn, reward=1.0, messages=None, versions=None):
    segs = [Segment(message_index=2 * i + 1, record_id=f"r{i}", version=(versions or [None] * 9)[i], tokens=t)
            for i, t in enumerate(tokens_per_turn)]
    msgs = messages or [m for i in range(len(segs)) for m in ({"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "a"})]
    return Sample(scenario="s", messages=msgs, segments=segs, reward=reward, report_id="rep", source_ids=["r0", "rep"])


def tokens(prompt, output, logprobs=None, version="base:0"):
    return {"prompt_ids": prompt, "output_ids": output,
            "output_logprobs": logprobs if logprobs is not None else [-1.0] * len(output), "version": version}


# --------------------------------------------------------------------------- token batches


def test_single_turn_row_and_batch_alignment():
    s = sample([tokens([5, 6, 7], [8, 9], [-0.5, -0.25])], reward=0.75)
    row = row_from_sample(s)
    assert row.input_ids == [5, 6, 7, 8, 9]
    assert row.action_mask == [0, 0, 0, 1, 1]
    assert row.rollout_logprobs == [0, 0, 0, -0.5, -0.25]
    tb = TokenBatch.from_rows([row, row_from_tokens([1, 2], [3], [-2.0], reward=0.0)], pad_token_id=99)
    assert tb.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 99, 99]]
    assert tb.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert tb.action_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    assert tb.rewards.tolist() == [0.75, 0.0]
    assert tb.response_lengths.tolist() == [2, 1] and tb.response_starts.tolist() == [3, 2]
    assert tb.norm_tokens == 3 and tb.norm_samples == 2
    assert tb.versions == [[None], [None]]


def test_multi_turn_marks_earlier_outputs_found_in_place_and_counts_the_rest():
    first = tokens([1, 2], [10, 11], [-0.1, -0.2])
    # The second prompt holds turn 1's prompt and output, then an observation (20, 21).
    second = tokens([1, 2, 10, 11, 20, 21], [30, 31], [-0.3, -0.4])
    row = row_from_sample(sample([first, second]))
    assert row.input_ids == [1, 2, 10, 11, 20, 21, 30, 31]
    assert row.action_mask == [0, 0, 1, 1, 0, 0, 1, 1]
    assert row.rollout_logprobs == [0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4]
    assert row.response_start == 2 and row.turns_matched == 2 and row.turns_unmatched == 0
    tb = TokenBatch.from_rows([row])
    assert tb.response_lengths.tolist() == [6]  # the whole span, observation tokens included
    assert tb.stats["observation_tokens"] == 2

    # Re-rendered history diverging after one token: that token stays an action, the rest is observation.
    partial = row_from_sample(sample([first, tokens([1, 2, 10, 99, 20], [30], [-0.3])]))
    assert partial.action_mask == [0, 0, 1, 0, 0, 1] and partial.turns_partial == 1
    # A rewritten prompt (not a prefix): the earlier turn is entirely observation.
    rewritten = row_from_sample(sample([first, tokens([7, 7, 10, 11], [30], [-0.3])]))
    assert rewritten.action_mask == [0, 0, 0, 0, 1] and rewritten.turns_unmatched == 1
    assert TokenBatch.from_rows([rewritten, partial]).stats["turns_unmatched"] == 1


@pytest.mark.parametrize("bad, message", [
    (None, "no token data"),
    ({"prompt_ids": [1], "output_ids": [2], "version": "v"}, "no rollout log-probs"),
    ({"prompt_ids": [1], "output_ids": [2, 3], "output_logprobs": [-1.0], "version": "v"}, "1 log-probs for 2"),
    ({"prompt_ids": [1], "output_ids": [2], "output_logprobs": [float("nan")], "version": "v"}, "finite"),
    ({"prompt_ids": [], "output_ids": [2], "output_logprobs": [-1.0], "version": "v"}, "empty prompt_ids"),
])
def test_a_sample_without_usable_token_data_is_refused(bad, message):
    with pytest.raises(TokenDataError, match=message) as info:
        row_from_sample(sample([bad]))
    assert isinstance(info.value, ValidationFailed) and "rep" in info.value.message
    # An earlier turn without log-probs refuses the whole sample too (nothing is recomputed).
    with pytest.raises(TokenDataError):
        row_from_sample(sample([bad, tokens([1, 2], [3])]))


def test_a_sample_without_a_finite_reward_is_refused():
    with pytest.raises(TokenDataError, match="reward"):
        row_from_sample(sample([tokens([1], [2])], reward=None))


def test_split_keeps_batch_normalisers_and_extras(tok):
    tb = TokenBatch.from_rows(rows(tok, 5)).with_extras(adv=torch.arange(5.0))
    parts = tb.split(2)
    assert [p.size for p in parts] == [2, 3]  # rounded bounds
    assert all(p.norm_tokens == tb.norm_tokens for p in parts)
    assert torch.cat([p.extras["adv"] for p in parts]).tolist() == [0, 1, 2, 3, 4]
    assert sum(int(p.action_mask.sum()) for p in parts) == tb.norm_tokens
    assert tb.split(10)[0].size == 1 and len(tb.split(10)) == 5


# --------------------------------------------------------------------------- objective helpers


def test_sequence_logprobs_matches_a_manual_forward(tok):
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    tb = TokenBatch.from_rows(rows(tok, 3), pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, tb)
        mask = tb.action_mask > 0
        # The rows' rollout log-probs were captured one token at a time, like the engine does.
        assert torch.allclose(lp[mask], tb.rollout_logprobs[mask], atol=1e-5)
        assert (lp[~mask & (torch.arange(tb.seq_len) < tb.response_starts.min())] == 0).all()


def test_value_model_copies_the_body_and_starts_at_zero(tok):
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    critic = ValueModel.from_policy(model)
    assert critic.body is not model.model
    assert torch.equal(critic.body.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(critic(ids, torch.ones_like(ids)), torch.zeros(1, 4))


# --------------------------------------------------------------------------- the trainer


def weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def logits(model, ids=torch.tensor([[1, 40, 41, 42, 300, 17, 2]])):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_full_step_changes_weights_and_payload_reloads_identically(tok, tmp_path):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2))
    before = weights(trainer.policy)
    update = trainer.step(TokenBatch.from_rows(rows(tok)))
    after = weights(trainer.policy)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert update.metrics["grad_norm"] > 0 and math.isfinite(update.metrics["loss"])
    # payload: every tensor except the tied lm_head; loading it into a fresh base gives the trained logits.
    assert "lm_head.weight" not in update.payload and "model.embed_tokens.weight" in update.payload
    fresh, _ = build_tiny_model(seed=0, tokenizer=tok)
    own = fresh.state_dict()
    with torch.no_grad():
        for k, v in update.payload.items():
            own[k].copy_(v)
    assert torch.equal(logits(fresh), logits(trainer.policy))
    # files: a directory from_pretrained loads, identical logits.
    assert MODEL_FILE in update.files and "config.json" in update.files and "tokenizer.json" in update.files
    for name, data in update.files.items():
        (tmp_path / name).write_bytes(data)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(logits(reloaded), logits(trainer.policy))
    assert AutoTokenizer.from_pretrained(tmp_path)("hello")["input_ids"] == tok("hello")["input_ids"]


def test_payload_is_a_snapshot_not_a_view(tok):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2))
    first = trainer.step(TokenBatch.from_rows(rows(tok)))
    kept = {k: v.clone() for k, v in first.payload.items()}
    trainer.step(TokenBatch.from_rows(rows(tok, seed=1)))
    assert all(torch.equal(kept[k], first.payload[k]) for k in kept)
    # files are serialised lazily from the step's own tensors, not the live policy
    state = load_safetensors(first.files[MODEL_FILE])
    assert all(torch.equal(state[k], kept[k]) for k in kept)


def test_lora_step_trains_only_the_adapter_and_exports_a_peft_dir(tok, tmp_path):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2, lora=True, lora_rank=4, lora_alpha=8))
    base_before = {k: v.clone() for k, v in trainer.policy.get_base_model().state_dict().items() if "lora_" not in k}
    update = trainer.step(TokenBatch.from_rows(rows(tok)))
    # B starts at zero, so one step moves it off zero; the base weights never move.
    lora_b = [p for n, p in trainer.policy.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)
    base_after = trainer.policy.get_base_model().state_dict()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    # payload: the adapter itself (config + its own tensors, unmerged), which peft loads onto a fresh base
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    assert isinstance(update.payload, AdapterWeights) and update.payload.config["r"] == 4
    assert all("lora_" in k for k in update.payload.tensors)
    fresh, _ = build_tiny_model(seed=0, tokenizer=tok)
    fresh = get_peft_model(fresh, PeftConfig.from_peft_type(**update.payload.config))
    set_peft_model_state_dict(fresh, dict(update.payload.tensors))
    assert torch.allclose(logits(fresh.eval()), logits(trainer.policy), atol=1e-6)
    # files: a PEFT adapter directory
    assert set(update.files) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert json.loads(update.files[ADAPTER_CONFIG])["r"] == 4
    for name, data in update.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    from peft import PeftModel

    base, _ = build_tiny_model(seed=0, tokenizer=tok)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert torch.allclose(logits(loaded), logits(trainer.policy), atol=1e-6)


def _captured_grads(trainer):
    grads = []
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.append([p.grad.detach().clone() for p in trainer._params])
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return grads


def test_gradient_accumulation_matches_one_big_batch(tok):
    batch = TokenBatch.from_rows(rows(tok, 4), pad_token_id=tok.pad_token_id)
    one = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-3, max_grad_norm=None))
    two = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-3, max_grad_norm=None, grad_accumulation=2))
    g1, g2 = _captured_grads(one), _captured_grads(two)
    u1, u2 = one.step(batch), two.step(batch)
    assert u1.metrics["loss"] == pytest.approx(u2.metrics["loss"], rel=1e-5)
    assert u1.metrics["grad_norm"] == pytest.approx(u2.metrics["grad_norm"], rel=1e-4)
    for a, b in zip(g1[0], g2[0]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    for k, v in u1.payload.items():
        assert torch.allclose(v, u2.payload[k], atol=1e-5)


def test_rejected_restores_the_last_accepted_state_and_accepted_commits(tok):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2))
    start = weights(trainer.policy)
    first = trainer.step(TokenBatch.from_rows(rows(tok)))
    trainer.accepted(first, "rel-1")
    committed = weights(trainer.policy)
    assert any(not torch.equal(start[k], committed[k]) for k in start)
    # the accepted payload itself is the rollback point (no second copy of the weights)
    assert any(saved is first.payload["model.norm.weight"] for saved in trainer._snapshot["params"])
    second = trainer.step(TokenBatch.from_rows(rows(tok, seed=3)))
    assert any(not torch.equal(committed[k], v) for k, v in weights(trainer.policy).items())
    trainer.rejected(second)
    assert all(torch.equal(committed[k], v) for k, v in weights(trainer.policy).items())
    assert trainer.steps == 1 and not trainer.optimizer.state  # the optimizer's moments restart
    # the rollback point survives the rejected step: rejecting again changes nothing
    trainer.step(TokenBatch.from_rows(rows(tok, seed=4)))
    trainer.rejected(None)
    assert all(torch.equal(committed[k], v) for k, v in weights(trainer.policy).items())


def _batch(samples):
    return Batch(batch_id="b1", samples=samples, record_ids=["r0", "rep"], scenario="s")


def test_train_refuses_a_batch_without_log_probs_before_touching_the_policy(tok):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2))
    before = weights(trainer.policy)
    ctx = TrainContext(scenario="s", step=1, serving_release_id=None, serving_version="base", algorithm_state=None)
    bad = sample([{"prompt_ids": [1, 2], "output_ids": [3], "version": "base"}])
    with pytest.raises(TokenDataError, match="log-probs"):
        trainer.train(_batch([bad]), ctx)
    assert all(torch.equal(before[k], v) for k, v in weights(trainer.policy).items())


def test_train_reports_metrics_and_resumes_from_a_release(tok):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2, lag_metric_prefix="x/"))
    prompt = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
    samples = [sample([tokens(prompt, [40], [float(lp[40])], version=v)], reward=r, versions=[v])
               for v, r in (("base:3", 1.0), ("base:5", 0.0))]
    ctx = TrainContext(scenario="s", step=1, serving_release_id=None, serving_version="base:5",
                       algorithm_state=None)
    update = trainer.train(_batch(samples), ctx)
    assert update.metrics["x/policy_lag_max"] == 2 and update.metrics["x/policy_lag_mean"] == 1
    assert update.metrics["reward_mean"] == 0.5 and update.metrics["seconds"] > 0
    assert update.source["objective"] == "reinforce" and update.algorithm_state["steps"] == 1
    json.dumps(update.metrics)  # JSON-safe
    # A fresh trainer whose scenario serves that release resumes from its files, and its step counter.
    resumed = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2))
    files = {k: update.files[k] for k in update.files}
    ctx2 = TrainContext(scenario="s", step=2, serving_release_id="rel-1", serving_version="base:6",
                        algorithm_state=update.algorithm_state, current_files=lambda: files)
    resumed._sync(ctx2)
    assert torch.equal(logits(resumed.policy), logits(trainer.policy))
    assert resumed.steps == 1


def test_policy_lag_ignores_other_incarnations_and_future_versions():
    assert policy_lag([["a:3"], ["a:1", "a:4"], ["b:2"], ["a:9"], [None]], "a:5") == [2, 4]
    assert policy_lag([["base"]], "base:2") == [2]
    assert policy_lag([["a:1"]], None) == []


def test_constructor_validation(tok):
    with pytest.raises(ConfigError):
        TorchTrainer(Reinforce(), None)
    with pytest.raises(ConfigError):
        TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=0))
    with pytest.raises(ConfigError):
        TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(grad_accumulation=0))


def test_trainer_device_follows_the_engine_and_holds_policy_batches_and_payload(tok):
    from reef_core.config.schema import TrainerConfig
    from reef_core.grow.trainer import TrainerSetup

    # trainer.device unset: the engine's resolved device (TrainerSetup.device) places everything.
    setup = TrainerSetup(data_dir=None, load_base_model=loader(tok), device="cpu")
    trainer = TorchTrainer.from_config(Reinforce(), setup, TrainerConfig(lr=1e-2), who="test")
    cpu = torch.device("cpu")
    assert trainer.device == cpu
    assert {p.device for p in trainer.policy.parameters()} == {cpu}
    batch = trainer.token_batch([sample([tokens([1, 40, 41], [300, 17])])])
    assert batch.device == cpu
    update = trainer.step(TokenBatch.from_rows(rows(tok)).to(trainer.device))
    assert {v.device for v in update.payload.values()} == {cpu}
    # An explicit trainer.device wins over the engine's and is checked under its own name.
    with pytest.raises(ConfigError, match=r"^trainer\.device=cuda:99 names a device this machine lacks"):
        TorchTrainer.from_config(Reinforce(), setup, TrainerConfig(device="cuda:99"), who="test")
    with pytest.raises(ConfigError, match=r"^trainer\.device must be one of"):
        TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(device="gpu"))


def test_lora_layers_adapts_only_the_top_layers_and_the_served_adapter_says_so(tok):
    trainer = TorchTrainer(Reinforce(), loader(tok),
                           TorchTrainerOptions(lr=1e-2, lora=True, lora_rank=4, lora_alpha=8, lora_layers=1))
    adapted = {n.split(".layers.")[1].split(".")[0] for n, _ in trainer.policy.named_parameters() if "lora_" in n}
    last = str(trainer.policy.get_base_model().config.num_hidden_layers - 1)
    assert adapted == {last}
    update = trainer.step(TokenBatch.from_rows(rows(tok)))
    assert update.payload.config["layers_to_transform"] == [int(last)]
    # peft rebuilds the same adapter from the release's config (the engine loads it this way)
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    fresh, _ = build_tiny_model(seed=0, tokenizer=tok)
    fresh = get_peft_model(fresh, PeftConfig.from_peft_type(**update.payload.config))
    set_peft_model_state_dict(fresh, dict(update.payload.tensors))
    assert torch.allclose(logits(fresh.eval()), logits(trainer.policy), atol=1e-6)


@pytest.mark.parametrize("layers", [0, -1, True, 2.5])
def test_lora_layers_is_validated(tok, layers):
    with pytest.raises(ConfigError, match="lora_layers"):
        TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2, lora=True, lora_layers=layers))


def test_lora_layers_beyond_the_model_is_an_error_naming_the_key(tok):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2, lora=True, lora_layers=99))
    with pytest.raises(ConfigError, match="lora_layers is 99"):
        trainer.load()


@pytest.mark.parametrize("lora", [False, True])
def test_a_rollback_to_the_creation_release_resyncs_the_policy_to_the_base(tok, lora):
    trainer = TorchTrainer(Reinforce(), loader(tok), TorchTrainerOptions(lr=1e-2, lora=lora, lora_rank=4, lora_alpha=8))
    base = logits(trainer.policy)
    creation = {"base.json": b'{"digest": "sha256:0", "model": "tiny"}'}
    ctx = TrainContext(scenario="s", step=2, serving_release_id="rel-0", serving_version="base:0",
                       algorithm_state=None, current_files=lambda: creation)
    trainer._sync(ctx)  # freshly loaded from the creation release: nothing to reset
    trainer.accepted(trainer.step(TokenBatch.from_rows(rows(tok))), "rel-1")
    assert not torch.allclose(logits(trainer.policy), base)
    # The head was rolled back to (a republish of) the creation release: the next step starts from the base.
    trainer._sync(TrainContext(scenario="s", step=3, serving_release_id="rel-2", serving_version="base:2",
                               algorithm_state=None, current_files=lambda: creation))
    assert torch.allclose(logits(trainer.policy), base, atol=1e-6)
    trainer.rejected(None)  # and that is the new rollback point
    assert torch.allclose(logits(trainer.policy), base, atol=1e-6)


# --------------------------------------------------------------------------- the step is the plain step, faster


def plain_logprobs(model, tb):
    """The straightforward computation: every position's full-vocabulary log_softmax, then the batch's tokens."""
    logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1]
    picked = torch.log_softmax(logits.float(), -1).gather(-1, tb.input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def test_action_positions_only_give_the_plain_log_probs(tok):
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    tb = TokenBatch.from_rows(rows(tok, 4), pad_token_id=tok.pad_token_id)  # rows of unequal lengths (padding)
    with torch.no_grad():
        fast, plain = sequence_logprobs(model, tb), plain_logprobs(model, tb)
    first = int(torch.nonzero(tb.action_mask.sum(0) > 0)[0])
    assert torch.allclose(fast[:, first:], plain[:, first:], rtol=0, atol=1e-5)
    assert (fast[:, :first] == 0).all()


def test_value_model_gives_each_position_the_value_of_the_state_before_it(tok):
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    critic = ValueModel.from_policy(model)
    torch.nn.init.normal_(critic.head.weight)
    tb = TokenBatch.from_rows(rows(tok, 3), pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        hidden = critic.body(input_ids=tb.input_ids, attention_mask=tb.attention_mask).last_hidden_state
        full = torch.nn.functional.pad(critic.head(hidden).squeeze(-1)[:, :-1], (1, 0))
        got = critic(tb.input_ids, tb.attention_mask)
    assert got.shape == full.shape and got.dtype == torch.float32
    assert torch.allclose(got, full, rtol=0, atol=1e-6)
    assert torch.equal(critic(tb.input_ids[:, :1], tb.attention_mask[:, :1]), torch.zeros(tb.size, 1))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_norm", [1e-3, 1e3, None])
def test_clipped_step_is_clip_grad_norm_then_step(fused, max_norm):
    from reef_core.grow.optim import clipped_step

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (11,), (3, 3))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused)
    ref = torch.optim.AdamW(twins, lr=0.1)
    for step in range(3):
        for p, q in zip(params, twins):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        norm = clipped_step(opt, params, max_norm)
        expected = torch.nn.utils.clip_grad_norm_(twins, max_norm if max_norm is not None else float("inf"))
        ref.step()
        assert norm == pytest.approx(float(expected), rel=1e-6)
        for p, q in zip(params, twins):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    assert not hasattr(opt, "grad_scale")


def test_clipped_step_with_a_non_finite_norm_steps_only_when_asked():
    from reef_core.grow.optim import clipped_step

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert math.isnan(clipped_step(opt, [p], 1.0))
    assert torch.equal(p.detach(), torch.ones(3)) and not opt.state
    assert math.isnan(clipped_step(opt, [p], 1.0, step_nonfinite=True))
    assert torch.isnan(p.detach()).all()  # as clip_grad_norm_ then step() would: the caller chose to step


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_step_equals_a_plain_hf_step(tok, lora):
    """Two trainer steps (clipping active) against the same steps written plainly: full logits, log_softmax,
    clip_grad_norm_, torch's default AdamW; the weights agree to float rounding."""
    opts = TorchTrainerOptions(lr=1e-2, max_grad_norm=0.05, lora=lora, lora_rank=4, lora_alpha=8)
    trainer = TorchTrainer(Reinforce(), loader(tok), opts)
    plain, _ = build_tiny_model(seed=0, tokenizer=tok)
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            plain = get_peft_model(plain, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
                                                     target_modules="all-linear", task_type="CAUSAL_LM"))
    else:
        plain.requires_grad_(True)
    plain.eval()
    params = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    for seed in (0, 1):
        tb = TokenBatch.from_rows(rows(tok, 4, seed=seed), pad_token_id=tok.pad_token_id)
        update = trainer.step(tb)
        opt.zero_grad(set_to_none=True)
        mask = tb.action_mask > 0
        adv = tb.rewards.unsqueeze(1) * tb.action_mask
        loss = -token_sum(adv * plain_logprobs(plain, tb), mask) / tb.norm_tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 0.05)
        opt.step()
        assert float(norm) > 0.05  # the clipping path ran
        assert update.metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
        assert update.metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    mine = dict(trainer.policy.named_parameters())
    for name, p in plain.named_parameters():
        # AdamW divides by sqrt(v): a near-zero gradient's rounding can move its weight by a sliver of lr (1e-2)
        assert torch.allclose(mine[name], p, rtol=1e-5, atol=1e-5), name
