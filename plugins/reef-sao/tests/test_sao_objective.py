"""SAO's objectives: golden vectors (recipe reference §12.2), the DIS band's exact zeros, observation skipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from reef_core.api import (
    ConfigError,
    Prepared,
    Sample,
    Segment,
    TokenBatch,
    TokenRow,
    TorchTrainer,
    TorchTrainerOptions,
    ValidationFailed,
    build_tiny_model,
    row_from_sample,
    row_from_tokens,
    sequence_logprobs,
)
from reef_sao.objectives import GRPODISObjective, SAOObjective
from reef_sao.rollouts import sample_rollouts

#: Tiny models run fastest single-threaded (intra-op threads mostly wait on each other).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

VALUES = [0.2, 0.3, 0.9, 0.9, 0.4, 0.5]
ACTION = [1, 1, 0, 0, 1, 1]


def sao(**kw):
    return SAOObjective(eps_clip=0.3, eps_clip_high=5.0, **kw)


def golden_batch():
    """The §12.2 trajectory behind one prompt token: response span 6, action mask [1, 1, 0, 0, 1, 1]."""
    row = TokenRow(input_ids=[1, 11, 12, 13, 14, 15, 16], action_mask=[0, *ACTION],
                   rollout_logprobs=[0.0] + [-1.0 if a else 0.0 for a in ACTION], reward=1.0, response_start=1)
    return TokenBatch.from_rows([row])


def test_gae_golden_vectors_through_the_objective():
    batch = golden_batch()
    values = torch.tensor([[0.0, *VALUES]])
    objective = sao()
    lam = objective.actor_lambdas(batch)
    assert lam.tolist() == pytest.approx([1 - 1 / (1.5 * 6)])  # 0.888889, keyed on the response span
    adv, ret = objective.advantages(values, batch)
    assert adv[0, 1:].tolist() == pytest.approx([0.619067, 0.583951, 0, 0, 0.544444, 0.5], rel=1e-5)
    assert ret[0, 1:].tolist() == pytest.approx([0.819067, 0.883951, 0, 0, 0.944444, 1.0], rel=1e-5)
    # critic targets: λ_critic = 1, Monte-Carlo returns; the observation values 0.9 never enter
    assert objective.critic_targets(values, batch)[0, 1:].tolist() == pytest.approx([1, 1, 0, 0, 1, 1])
    fixed = SAOObjective(eps_clip=0.3, eps_clip_high=5.0, length_adaptive_lambda=False, lam=1.0)
    adv1, ret1 = fixed.advantages(values, batch)
    assert adv1[0, 1:].tolist() == pytest.approx([0.8, 0.7, 0, 0, 0.6, 0.5], rel=1e-6)
    assert ret1[0, 1:].tolist() == pytest.approx([1, 1, 0, 0, 1, 1])
    # the observation values do not matter at all
    other = values.clone()
    other[0, 3:5] = -7.0
    assert torch.equal(objective.advantages(other, batch)[0], adv)


def _ratio_batch(ratios, adv=1.0):
    """One sample whose action tokens have the given policy/rollout ratios: logp = 0 - ..., rollout = -log r."""
    n = len(ratios)
    rollout = [0.0] + [-math.log(r) - 1.0 for r in ratios]  # policy logp will be -1.0 on every token
    row = TokenRow(input_ids=list(range(n + 1)), action_mask=[0] + [1] * n, rollout_logprobs=rollout,
                   reward=0.0, response_start=1)
    batch = TokenBatch.from_rows([row])
    batch.rollout_logprobs = batch.rollout_logprobs.double()
    return batch.with_extras(advantages=torch.full((1, n + 1), adv, dtype=torch.float64) * batch.action_mask)


def test_dis_calibration_golden_vector_and_exact_zero_gradient_outside_the_band():
    ratios = [0.69, 0.70, 0.71, 1.0, 5.99, 6.0, 6.1]
    objective = sao()
    expected = [0, 0, 0.71, 1.0, 5.99, 0, 0]
    assert objective.band_weight(torch.tensor(ratios, dtype=torch.float64)).tolist() == pytest.approx(expected)
    batch = _ratio_batch(ratios, adv=2.0)
    logp = torch.full((1, len(ratios) + 1), -1.0, dtype=torch.float64, requires_grad=True)
    loss, sums = objective.token_loss(logp, batch)
    loss.backward()
    # ∂ℓ/∂logp_t = −f(r_t)·A_t / N: the IS policy gradient inside the band, exactly zero outside
    grads = logp.grad[0, 1:].tolist()
    assert grads == pytest.approx([-w * 2.0 / len(ratios) for w in expected], rel=1e-6)
    assert [g == 0.0 for g in grads] == [w == 0 for w in expected]
    assert sums["clipped"] == 4 and sums["tokens"] == 7
    assert objective.summarize(Prepared(batch=batch), sums)["pg_clipfrac"] == pytest.approx(4 / 7)


def test_a_token_pushed_outside_the_band_contributes_exactly_zero_gradient_to_the_model(tok):
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    chats = [[{"role": "user", "content": f"hi {i}"}] for i in range(2)]
    rolls = sample_rollouts(model, tok, chats, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    batch = TokenBatch.from_rows([row_from_tokens(r.prompt_ids, r.output_ids, r.output_logprobs, 1.0)
                                  for r in rolls], pad_token_id=tok.pad_token_id)
    adv = torch.linspace(0.5, 1.5, batch.seq_len).expand(batch.size, -1) * batch.action_mask
    objective = sao()

    def grads(b):
        model.zero_grad()
        loss, _ = objective.loss(model, b, Prepared(batch=b))
        loss.backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    base = grads(batch.with_extras(advantages=adv))
    target = (0, int(batch.response_starts[0]) + 1)  # the second token of the first response
    perturbed = batch.with_extras(advantages=adv)
    perturbed.rollout_logprobs = batch.rollout_logprobs.clone()
    perturbed.rollout_logprobs[target] += 5.0  # ratio e^-5 < 1 - ε_l: outside the band
    outside = grads(perturbed)
    # Reference: the same batch with that token's advantage zeroed (the normaliser unchanged).
    silenced_adv = adv.clone()
    silenced_adv[target] = 0.0
    silenced = grads(batch.with_extras(advantages=silenced_adv))
    assert any(not torch.allclose(a, b) for a, b in zip(base, outside))
    for a, b in zip(outside, silenced):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)


class FixedValues(nn.Module):
    """A critic whose values are free parameters (one per position)."""

    def __init__(self, values):
        super().__init__()
        self.values = nn.Parameter(values.clone())

    def forward(self, input_ids, attention_mask=None):
        return self.values[:, : input_ids.shape[1]]


def test_observation_tokens_get_zero_advantage_and_no_critic_loss():
    batch = golden_batch()
    objective = sao(critic_steps_per_actor=1)
    objective.micro_batches = 1
    start = torch.tensor([[0.0, *VALUES]])
    objective.critic = FixedValues(start)
    objective.critic_optimizer = torch.optim.SGD(objective.critic.parameters(), lr=0.5)
    prepared = objective.prepare(None, batch)
    moved = (objective.critic.values.detach() != start)[0].tolist()
    assert moved == [False, True, True, False, False, True, True]  # only action tokens were regressed
    targets = torch.tensor([1.0, 1, 0, 0, 1, 1])
    mask = torch.tensor(ACTION, dtype=torch.bool)
    expected = float(((torch.tensor(VALUES) - targets)[mask] ** 2).mean())
    assert prepared.metrics["critic/loss"] == pytest.approx(expected)
    assert prepared.batch.extras["advantages"][0, 3:5].tolist() == [0.0, 0.0]
    assert (prepared.batch.extras["advantages"][0, [1, 2, 5, 6]] != 0).all()
    assert prepared.metrics["sao/effective_token_rate"] == pytest.approx(4 / 6)


def test_multi_turn_sample_end_to_end_through_the_sao_trainer(tok):
    """A two-turn trajectory with an environment observation between the actions trains without touching it."""
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    gen = torch.Generator().manual_seed(1)
    chat = [{"role": "user", "content": "start"}]
    first = sample_rollouts(model, tok, [chat], max_new_tokens=3, generator=gen)[0]
    # The client sends back the model's exact tokens (decoded text re-encodes identically only by luck), so
    # build turn 2's prompt from the ids: turn 1's prompt + output + an observation.
    observation = tok("<|im_end|>\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)["input_ids"]
    prompt2 = first.prompt_ids + first.output_ids + observation
    with torch.no_grad():
        ids, lps = list(prompt2), []
        for _ in range(2):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    sample = Sample(scenario="s", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                            {"role": "user", "content": "obs"}, {"role": "assistant", "content": "z"}],
                    segments=[Segment(1, "r1", "base", tokens=first.tokens("base")),
                              Segment(3, "r2", "base", tokens={"prompt_ids": prompt2, "output_ids": ids[len(prompt2):],
                                                               "output_logprobs": lps, "version": "base"})],
                    reward=1.0, report_id="rep")
    row = row_from_sample(sample)
    assert sum(row.action_mask) == len(first.output_ids) + 2 and row.turns_matched == 2
    trainer = TorchTrainer(sao(critic_lr=1e-2), lambda: build_tiny_model(seed=0, tokenizer=tok),
                           TorchTrainerOptions(lr=1e-2))
    batch = TokenBatch.from_rows([row], pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        lp = sequence_logprobs(trainer.policy, batch)
    assert torch.allclose(lp[batch.action_mask > 0], batch.rollout_logprobs[batch.action_mask > 0], atol=1e-5)
    update = trainer.step(batch)
    assert update.metrics["pg_clipfrac"] == 0.0 and update.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert update.metrics["batch/observation_tokens"] == len(observation)
    assert update.algorithm_state["objective_state"] == {"batches": 1, "actor_steps": 1, "critic_updates": 2}


def test_critic_only_warm_up_yields_no_candidate_then_trains_the_actor(tok):
    trainer = TorchTrainer(sao(num_critic_only_steps=1, critic_lr=1e-2),
                           lambda: build_tiny_model(seed=0, tokenizer=tok),
                           TorchTrainerOptions(lr=1e-2))
    batch = TokenBatch.from_rows([row_from_tokens([1, 2, 3], [4, 5], [-6.0, -6.0], 1.0)])
    trainer.load()
    head_before = trainer.objective.critic.head.weight.detach().clone()
    policy_before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    assert trainer.step(batch) is None
    assert not torch.equal(trainer.objective.critic.head.weight, head_before)  # the critic learned
    assert all(torch.equal(v, trainer.policy.state_dict()[k]) for k, v in policy_before.items())
    assert trainer.step(batch) is not None


def test_rejection_rolls_the_critic_back_with_the_policy(tok):
    trainer = TorchTrainer(sao(critic_lr=1e-2), lambda: build_tiny_model(seed=0, tokenizer=tok),
                           TorchTrainerOptions(lr=1e-2))
    batch = TokenBatch.from_rows([row_from_tokens([1, 2, 3], [4, 5], [-6.0, -6.0], 1.0)])
    trainer.load()
    critic0 = {k: v.clone() for k, v in trainer.objective.critic.state_dict().items()}
    update = trainer.step(batch)
    assert not torch.equal(trainer.objective.critic.head.weight, critic0["head.weight"])
    trainer.rejected(update)
    assert all(torch.equal(v, trainer.objective.critic.state_dict()[k]) for k, v in critic0.items())
    assert trainer.objective.json_state() == {"batches": 0, "actor_steps": 0, "critic_updates": 0}


def test_a_lora_critic_trains_its_adapter_and_head_over_a_frozen_body(tok):
    trainer = TorchTrainer(sao(critic_lr=1e-2, critic_lora=(4, 8.0, None)),
                           lambda: build_tiny_model(seed=0, tokenizer=tok),
                           TorchTrainerOptions(lr=1e-2))
    batch = TokenBatch.from_rows([row_from_tokens([1, 2, 3], [4, 5], [-6.0, -6.0], 1.0)])
    trainer.load()
    critic = trainer.objective.critic
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or n.startswith("head.") for n in trained)
    assert {"head.weight", "head.bias"} <= trained
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    trainer.step(batch)
    moved = {n for n, p in critic.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= trained and "head.weight" in moved
    assert any("lora_" in n for n in moved)  # the adapter learned too (its B factor leaves zero)
    with pytest.raises(ConfigError, match="critic's LoRA rank"):
        sao(critic_lora=(0, 8.0, None))


def test_a_lora_critic_on_the_top_layer_leaves_the_layers_below_it_alone(tok):
    trainer = TorchTrainer(sao(critic_lr=1e-2, critic_lora=(4, 8.0, 1)),
                           lambda: build_tiny_model(seed=0, tokenizer=tok),
                           TorchTrainerOptions(lr=1e-2, lora=True, lora_layers=1))
    trainer.load()
    critic = trainer.objective.critic
    last = critic.body.config.num_hidden_layers - 1
    adapted = {n for n, _ in critic.named_parameters() if "lora_" in n}
    assert adapted and all(f"layers.{last}." in n for n in adapted)
    trainer.step(TokenBatch.from_rows([row_from_tokens([1, 2, 3], [4, 5], [-6.0, -6.0], 1.0)]))


def test_grpo_advantages_by_key_or_consecutive_groups():
    objective = GRPODISObjective(eps_clip=0.3, eps_clip_high=5.0, group_size=2)
    rows = [row_from_tokens([1], [2], [-1.0], r, group_key=k) for r, k in
            [(1.0, "a"), (0.0, "b"), (0.0, "a"), (0.5, "b")]]
    adv, uniform = objective.sample_advantages(TokenBatch.from_rows(rows))
    assert adv.tolist() == pytest.approx([0.5, -0.25, -0.5, 0.25]) and uniform == 0
    for r in rows:
        r.group_key = None
    adv, uniform = objective.sample_advantages(TokenBatch.from_rows(rows))  # consecutive pairs
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.25, 0.25])
    # the same key twice over (one prompt asked in two groups): two groups, as the processor released them
    twice = [row_from_tokens([1], [2], [-1.0], r, group_key="k") for r in (1.0, 0.0, 0.4, 0.0)]
    adv, _ = objective.sample_advantages(TokenBatch.from_rows(twice))
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.2, -0.2])
    same = [row_from_tokens([1], [2], [-1.0], 1.0) for _ in range(2)]
    assert objective.sample_advantages(TokenBatch.from_rows(same))[1] == 1
    prepared = objective.prepare(None, TokenBatch.from_rows(rows))
    assert prepared.batch.extras["advantages"][:, 1].tolist() == pytest.approx([0.5, -0.5, -0.25, 0.25])
    with pytest.raises(ValidationFailed, match="groups of 2"):
        objective.prepare(None, TokenBatch.from_rows(rows[:3]))


def test_a_reported_rollout_without_log_probs_is_refused_by_the_sao_trainer(tok):
    """Records from an engine that captured no log-probs: the real processor builds the sample, the trainer refuses
    it with a 400-class error (the learner drops the batch with that reason) and nothing is recomputed."""
    from reef_core.api import Record, RecipeConfig, TokenDataError, TrainContext, TrainerConfig, TrainerSetup
    from reef_core.testing import PerReportProcessor
    from reef_sao.trainer import make_sao_trainer

    trainer = make_sao_trainer(scenario="s", recipe=RecipeConfig(options={"batch_size": 1, "eps_clip_high": 5.0}),
                               trainer=TrainerConfig(lr=1e-3), context=TrainerSetup(
                                   data_dir=None, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok)))
    proc = PerReportProcessor("s", batch_size=1)
    inference = Record(record_id="inf", scenario="s", kind="inference", sequence=1, version="base", payload={
        "route": "chat", "dialect": "openai", "request": {"messages": [{"role": "user", "content": "hi"}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": "a"}}]},
        "tokens": {"prompt_ids": [1, 2], "output_ids": [3], "version": "base"}})
    proc.ingest(inference)
    proc.ingest(Record(record_id="rep", scenario="s", kind="report", sequence=2, payload={"score": 1.0},
                       references=["inf"]))
    batch = proc.pending_batch()
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    ctx = TrainContext(scenario="s", step=1, serving_release_id=None, serving_version="base", algorithm_state=None)
    with pytest.raises(TokenDataError, match="no rollout log-probs") as info:
        trainer.train(batch, ctx)
    assert info.value.status == 400
    assert all(torch.equal(v, trainer.policy.state_dict()[k]) for k, v in before.items())
    assert trainer.objective.json_state()["batches"] == 0  # the critic did not step either


def test_the_critic_steps_equal_plain_critic_steps(tok):
    """SAO's critic steps (clipping folded into the fused AdamW) against the same steps
    written plainly: a full body forward + head, MSE to the first pass's returns, clip_grad_norm_, torch's
    default AdamW; the critic's weights and the actor's advantages agree to float rounding."""
    from reef_core.api import ValueModel, skip_observation_gae

    objective = sao(critic_lr=1e-2, critic_max_grad_norm=0.05)
    trainer = TorchTrainer(objective, lambda: build_tiny_model(seed=0, tokenizer=tok), TorchTrainerOptions(lr=1e-2))
    rows = [row_from_tokens([1, 2, 3, 7], [4, 5, 6], [-6.0] * 3, 1.0), row_from_tokens([1, 9], [8, 4], [-5.0] * 2, 0.0)]
    batch = TokenBatch.from_rows(rows, pad_token_id=tok.pad_token_id)
    plain = ValueModel.from_policy(build_tiny_model(seed=0, tokenizer=tok)[0])
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)  # the critic's default
    mask = batch.action_mask > 0

    def values():
        hidden = plain.body(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        return nn.functional.pad(plain.head(hidden).squeeze(-1)[:, :-1], (1, 0))

    for step in range(2):  # the trainer's step runs both critic steps; plain, one after the other
        if step == 0:
            prepared = objective.prepare(trainer.policy, batch)
        opt.zero_grad(set_to_none=True)
        v = values()
        if step == 0:
            returns = skip_observation_gae(v.detach(), batch.action_mask, batch.rewards)[1]
        last = v.detach()
        loss = torch.where(mask, (v - returns) ** 2, torch.zeros_like(v)).sum() / batch.norm_tokens
        loss.backward()
        assert float(torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.05)) > 0.05  # clipping ran
        opt.step()
    mine = dict(objective.critic.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.allclose(mine[name], p, rtol=1e-5, atol=1e-5), name  # (AdamW: see the trainer's test)
    adv, _ = objective.advantages(last, batch)
    assert torch.allclose(prepared.batch.extras["advantages"], adv.float(), rtol=1e-5, atol=1e-6)
