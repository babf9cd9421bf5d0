"""TTT's objective on the tiny model: entropic advantages per group, the KL to the base centred over the whole batch
and folded into the advantage, and the un-clipped importance-sampling loss summed over tokens."""

from __future__ import annotations

import pytest
import torch

from reef_core.api import TokenBatch, build_tiny_model, row_from_tokens, sequence_logprobs
from reef_ttt.advantages import group_advantages
from reef_ttt.objective import TTTObjective


class FixedReference:
    """A base whose log-probs are the rollout's minus a known per-token gap."""

    def __init__(self, gap: float):
        self.gap = gap

    def logprobs(self, batch):
        return (batch.rollout_logprobs - self.gap * torch.arange(batch.seq_len).float()) * batch.action_mask


@pytest.fixture(scope="module")
def model():
    policy, _tok = build_tiny_model(seed=0)
    policy.eval()
    return policy


def _batch(policy, rewards):
    rows = []
    for i, r in enumerate(rewards):
        prompt, output = [1, 2, 3 + i], [10 + i, 20, 30 + i]
        rows.append(row_from_tokens(prompt, output, [0.0] * 3, r, group_key=f"0:{i // 4}"))
    batch = TokenBatch.from_rows(rows)
    with torch.no_grad():
        logp = sequence_logprobs(policy, batch)
    return TokenBatch.from_rows([row_from_tokens(r.input_ids[:3], r.input_ids[3:], logp[i, 3:].tolist(), r.reward,
                                                 group_key=r.group_key) for i, r in enumerate(rows)])


def test_advantages_kl_and_token_sum_loss(model):
    rewards = [0.0, 0.0, 0.0, 1.0, 0.1, 0.2, 0.3, 0.4]
    batch = _batch(model, rewards)
    objective = TTTObjective(kl_coef=0.1)
    objective.setup(model, None, "cpu", reference=FixedReference(gap=0.01))
    prepared = objective.prepare(model, batch)
    adv = prepared.batch.extras["advantages"]
    mask = batch.action_mask
    expected = torch.cat([group_advantages(rewards[:4])[0], group_advantages(rewards[4:])[0]])
    d = 0.01 * torch.arange(batch.seq_len).float() * mask
    d_mean = d.sum() / mask.sum()
    want = (expected.unsqueeze(1) + 0.1 * (d_mean - d)) * mask
    assert torch.allclose(adv, want, atol=1e-5)
    assert prepared.metrics["ttt/kl_to_base"] == pytest.approx(float(d_mean), rel=1e-5)
    loss, sums = objective.loss(model, prepared.batch, prepared)
    # ratio 1 (rollout log-probs are the policy's): the loss is minus the sum of the token advantages, no average
    assert float(loss.detach()) == pytest.approx(-float(want.sum()), rel=1e-4, abs=1e-4)
    assert sums["tokens"] == 24
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_no_kl_means_no_reference_and_plain_group_advantages(model):
    objective = TTTObjective(kl_coef=0.0)
    assert not objective.needs_reference
    batch = _batch(model, [0.0, 1.0, 1.0, 0.0])
    objective.setup(model, None, "cpu")
    adv = objective.prepare(model, batch).batch.extras["advantages"]
    assert torch.allclose(adv[:, 3:], torch.tensor([[-1.0], [2.0], [2.0], [-1.0]]).expand(4, 3), atol=1e-4)


def test_the_control_arm_zeroes_every_gradient_so_adam_leaves_the_weights(model):
    """``learn=False`` (``+ttt_arm=control``): the step runs, its metrics are the learning arm's, the weights stay."""
    rewards = [0.0, 0.0, 0.0, 1.0, 0.1, 0.2, 0.3, 0.4]
    batch = _batch(model, rewards)
    learning, control = TTTObjective(kl_coef=0.0), TTTObjective(kl_coef=0.0, learn=False)
    for objective in (learning, control):
        objective.setup(model, None, "cpu")
    prepared = control.prepare(model, batch)
    assert prepared.metrics == learning.prepare(model, batch).metrics  # the same groups and advantages reported
    assert float(prepared.batch.extras["advantages"].abs().sum()) == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    loss, _ = control.loss(model, prepared.batch, prepared)
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
