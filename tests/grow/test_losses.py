"""Shared training losses: golden vectors (recipes.md §12), gradients, oracles, refusals."""

from __future__ import annotations

import math
import random

import pytest
import torch

from torch import Tensor

from reef_core.grow.losses import (
    _per_token,
    centered_kl_advantages,
    clipped_surrogate,
    dis_weight,
    entropic_adaptive_beta_loo,
    explained_variance,
    gather_logprobs,
    grpo_advantages,
    length_adaptive_lambda,
    masked_mean,
    masked_sum,
    skip_observation_gae,
)

# The recipe reference's token-mean losses: no objective calls them (each scales by the whole batch's normalisers),
# so they live here with their golden vectors, built on the core's terms (moved from reef_core/grow/losses.py).

_PPO_LOG_RATIO_CLAMP = 20.0


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, token mean over ``mask``.

    Per token ``max(-A·ρ, -A·clip(ρ, 1 - eps_low, 1 + eps_high))`` with
    ``ρ = exp(clamp(logp - old_logp, -20, 20))``. ``advantages`` is ``[B]`` or ``[B, T]``.
    ``old_logp`` is normally the rollout log-probs (refused if missing or NaN on a trained token).
    Metrics: ``clip_fraction`` (masked tokens where the clipped branch wins), ``ratio_mean``,
    ``approx_kl`` (mean of ``old_logp - logp``).
    """
    adv = _per_token(advantages, logp).to(logp.dtype)
    m = mask.to(torch.bool)
    safe_old = torch.where(m, _require_rollout_logp(old_logp, m), logp.detach())
    log_ratio = (logp - safe_old).clamp(-_PPO_LOG_RATIO_CLAMP, _PPO_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    per_token = clipped_surrogate(adv, ratio, eps_low, eps_high)
    loss = masked_mean(per_token, m)
    with torch.no_grad():
        clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        metrics = {
            "clip_fraction": float(masked_mean((clipped > -adv * ratio).to(logp.dtype), m)),
            "ratio_mean": float(masked_mean(ratio, m)),
            "approx_kl": float(masked_mean(-log_ratio, m)),
        }
    return loss, metrics


def _require_rollout_logp(rollout_logp: Tensor | None, mask: Tensor) -> Tensor:
    # An importance ratio needs the engine's own log-probs; recomputing them changes the estimator.
    if rollout_logp is None:
        raise ValueError("rollout log-probs are required (a rollout without them is never recomputed)")
    if torch.isnan(torch.where(mask.to(torch.bool), rollout_logp, torch.zeros_like(rollout_logp))).any():
        raise ValueError("rollout log-probs contain NaN on trained tokens; refusing to recompute them")
    return rollout_logp


def dis_loss(
    logp: Tensor,
    rollout_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
) -> tuple[Tensor, dict[str, float]]:
    """SAO's direct double-sided importance-sampling loss, mean over masked tokens.

    ``ℓ_t = -sg(f(r_t))·A_t·logp_t`` with ``r_t = exp(logp_t - rollout_logp_t)`` and ``f`` the
    strict band of :func:`dis_weight`: inside the band the gradient is the IS policy gradient,
    outside it is exactly zero. ``rollout_logp`` must be the engine's log-probs captured at
    generation time: ``None`` or NaN on a trained token raises :class:`ValueError`.
    Metrics: ``clip_fraction`` (masked tokens outside the band), ``ratio_mean``.
    """
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must lie in [0, 1), got {eps_low}")
    if eps_high <= 0.0:
        raise ValueError(f"eps_high must be positive, got {eps_high}")
    m = mask.to(torch.bool)
    rollout = _require_rollout_logp(rollout_logp, m)
    adv = _per_token(advantages, logp).to(logp.dtype)
    with torch.no_grad():
        ratio = torch.exp(logp.detach() - torch.where(m, rollout, logp.detach()))
        weight = dis_weight(ratio, eps_low, eps_high)
    per_token = -weight * adv * logp
    loss = masked_mean(per_token, m)
    with torch.no_grad():
        metrics = {
            "clip_fraction": float(masked_mean((weight == 0).to(logp.dtype), m)),
            "ratio_mean": float(masked_mean(ratio, m)),
        }
    return loss, metrics


def critic_loss(values: Tensor, returns: Tensor, action_mask: Tensor) -> Tensor:
    """Mean squared error of ``values`` toward ``returns`` over action tokens only."""
    return masked_mean((values - returns.detach()) ** 2, action_mask)


def importance_sampling_loss(
    logp: Tensor, sampler_logp: Tensor | None, advantages: Tensor, mask: Tensor
) -> Tensor:
    """TTT-Discover's un-clipped IS loss: ``-Σ_masked exp(logp - sampler_logp)·A`` (token sum).

    Divide by the number of rollouts yourself if you want the probe's per-group scale.
    ``sampler_logp`` must be the captured rollout log-probs (refused if missing or NaN).
    """
    m = mask.to(torch.bool)
    sampler = _require_rollout_logp(sampler_logp, m)
    adv = _per_token(advantages, logp).to(logp.dtype)
    ratio = torch.exp(logp - torch.where(m, sampler, logp.detach()))
    return -masked_sum(ratio * adv, m)


def opd_advantage(teacher_logp: Tensor, rollout_logp: Tensor, clip: float | None = 1.0) -> Tensor:
    """Sampled-token distillation advantage ``clip(logπ_T - logπ_rollout, -clip, clip)``.

    ``clip=None`` leaves it unclipped (plain sampled-token reverse KL of §9.2). Detached.
    """
    adv = (teacher_logp - rollout_logp).detach()
    if clip is None:
        return adv
    if clip <= 0:
        raise ValueError(f"clip must be positive or None, got {clip}")
    return adv.clamp(-clip, clip)


ATOL = 1e-5

# §12.2 fixture: reward 1.0 on the last action token, observation span in the middle.
GAE_VALUES = torch.tensor([0.2, 0.3, 0.9, 0.9, 0.4, 0.5])
GAE_MASK = torch.tensor([1, 1, 0, 0, 1, 1])


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# --------------------------------------------------------------------------- GRPO / PPO


def test_grpo_advantages_are_group_relative():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    close(grpo_advantages(r, 4), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    normed = grpo_advantages(r, 4, normalize_std=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    close(normed[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    close(normed[4:], [0, 0, 0, 0])  # a uniform group gives no signal, never a division by zero
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(6), 4)


def test_ppo_clip_loss_values_and_clip_fraction():
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5, 1.1]])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = ppo_clip_loss(logp, old, adv, mask)
    # token 0: ratio 1.5 clipped at 1.28 (A>0); token 1: 1.0; token 2: ratio 0.5, A<0 -> max(0.5, 0.8) = 0.8
    close(loss, (-1.28 - 1.0 + 0.8) / 3)
    close(metrics["clip_fraction"], 2 / 3)
    loss.backward()
    grad = logp.grad[0]
    assert grad[0] == 0 and grad[2] == 0 and grad[3] == 0  # clipped tokens and the masked one
    close(grad[1], -1.0 / 3)


def test_ppo_per_sample_advantages_broadcast():
    torch.manual_seed(0)
    logp, old = torch.randn(3, 5) * 0.1, torch.randn(3, 5) * 0.1
    mask = torch.ones(3, 5)
    adv = torch.tensor([0.5, -1.0, 2.0])
    a, _ = ppo_clip_loss(logp, old, adv, mask)
    b, _ = ppo_clip_loss(logp, old, adv[:, None].expand(3, 5), mask)
    close(a, b)


# --------------------------------------------------------------------------- SAO: λ and GAE


def test_length_adaptive_lambda():
    close(length_adaptive_lambda(6), 1 - 1 / 9)
    assert length_adaptive_lambda(6, alpha=1.5) == pytest.approx(0.888889, abs=1e-6)
    assert length_adaptive_lambda(0) == 0.0
    assert length_adaptive_lambda(0.5) == 0.0  # 1 - 1/0.75 < 0 is clamped
    assert 0.999 < length_adaptive_lambda(10_000) <= 1.0


def test_gae_golden_lambda_one():
    adv, ret = skip_observation_gae(GAE_VALUES, GAE_MASK, 1.0, gamma=1.0, lam=1.0)
    close(adv, [0.8, 0.7, 0, 0, 0.6, 0.5])
    close(ret, [1, 1, 0, 0, 1, 1])


def test_gae_golden_length_adaptive_lambda():
    lam = length_adaptive_lambda(6)  # whole response span, observation tokens included
    adv, ret = skip_observation_gae(GAE_VALUES, GAE_MASK, 1.0, lam=lam)
    close(adv, [0.619067, 0.583951, 0, 0, 0.544444, 0.5])
    close(ret, [0.819067, 0.883951, 0, 0, 0.944444, 1.0])


def test_gae_observation_values_never_enter_the_recurrence():
    perturbed = GAE_VALUES.clone()
    perturbed[2:4] = torch.tensor([-7.0, 42.0])
    for lam in (1.0, 0.5):
        a1, r1 = skip_observation_gae(GAE_VALUES, GAE_MASK, 1.0, lam=lam)
        a2, r2 = skip_observation_gae(perturbed, GAE_MASK, 1.0, lam=lam)
        close(a1, a2)
        close(r1, r2)
        assert torch.all(a2[2:4] == 0) and torch.all(r2[2:4] == 0)


def _gae_oracle(values, mask, reward, gamma, lam):
    """Pure-Python skip-observation GAE: list the action positions, recurse over them only."""
    actions = [t for t, m in enumerate(mask) if m]
    adv, ret = [0.0] * len(values), [0.0] * len(values)
    next_v, next_a = 0.0, 0.0
    for i, t in reversed(list(enumerate(actions))):
        r_t = reward if i == len(actions) - 1 else 0.0
        delta = r_t + gamma * next_v - values[t]
        a = delta + gamma * lam * next_a
        adv[t], ret[t] = a, a + values[t]
        next_v, next_a = values[t], a
    return adv, ret


def test_gae_matches_pure_python_oracle_on_random_batches():
    rng = random.Random(1234)
    for _ in range(25):
        batch, length = rng.randint(1, 5), rng.randint(1, 12)
        values = [[rng.uniform(-2, 2) for _ in range(length)] for _ in range(batch)]
        masks = [[int(rng.random() < 0.6) for _ in range(length)] for _ in range(batch)]
        rewards = [rng.uniform(-1, 2) for _ in range(batch)]
        lams = [rng.uniform(0, 1) for _ in range(batch)]
        gamma = rng.choice([1.0, 0.9])
        adv, ret = skip_observation_gae(
            torch.tensor(values), torch.tensor(masks), torch.tensor(rewards), gamma=gamma, lam=torch.tensor(lams)
        )
        for b in range(batch):
            exp_adv, exp_ret = _gae_oracle(values[b], masks[b], rewards[b], gamma, lams[b])
            close(adv[b], exp_adv)
            close(ret[b], exp_ret)
            # single-sample form agrees with the batched one
            a1, r1 = skip_observation_gae(
                torch.tensor(values[b]), torch.tensor(masks[b]), rewards[b], gamma=gamma, lam=lams[b]
            )
            close(a1, adv[b])
            close(r1, ret[b])


def test_gae_reward_lands_on_last_action_token_before_padding():
    values = torch.zeros(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 0, 1, 0]])
    adv, ret = skip_observation_gae(values, mask, torch.tensor([2.0, -1.0]))
    close(adv, [[2, 2, 2, 0, 0], [0, -1, 0, -1, 0]])
    close(ret, adv)


# --------------------------------------------------------------------------- SAO: DIS and critic


def test_dis_weight_golden_calibration():
    r = torch.tensor([0.69, 0.70, 0.71, 1.0, 5.99, 6.0, 6.1])
    close(dis_weight(r, 0.3, 5.0), [0, 0, 0.71, 1.0, 5.99, 0, 0])
    close(dis_weight(r.double(), 0.3, 5.0), [0, 0, 0.71, 1.0, 5.99, 0, 0])


def test_dis_token_outside_band_gets_exactly_zero_gradient():
    torch.manual_seed(0)
    base = torch.log_softmax(torch.randn(2, 6, 9), dim=-1)[..., 0]
    rollout = base.clone()
    rollout[0, 3] = base[0, 3] + 2.0  # ratio exp(-2) ≈ 0.135 < 0.7: outside the band
    rollout[1, 1] = base[1, 1] - 0.1  # ratio exp(0.1) ≈ 1.105: inside the band
    adv = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 6)
    logp = base.clone().requires_grad_()
    loss, metrics = dis_loss(logp, rollout, adv, mask)
    loss.backward()
    grad = logp.grad
    assert grad[0, 3].item() == 0.0
    others = torch.ones_like(grad, dtype=torch.bool)
    others[0, 3] = False
    assert torch.all(grad[others] != 0)
    # inside the band the gradient is the ordinary IS policy gradient: -r·A / n_tokens
    ratio = torch.exp(base - rollout)
    expected = -ratio * adv[:, None] / 12
    close(grad[others], expected[others])
    close(metrics["clip_fraction"], 1 / 12)


def test_dis_loss_value_and_mask():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -2.0, float("nan")]])  # NaN outside the mask is tolerated
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = dis_loss(logp, rollout, torch.tensor([[2.0, 2.0, 2.0]]), mask)
    close(loss, -(2.0 * -1.0 + 2.0 * -2.0) / 2)
    assert metrics["clip_fraction"] == 0.0
    loss.backward()
    assert logp.grad[0, 2] == 0


def test_dis_refuses_missing_rollout_logprobs():
    logp = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    with pytest.raises(ValueError, match="rollout log-probs"):
        dis_loss(logp, None, torch.ones(1), mask)
    with pytest.raises(ValueError, match="NaN"):
        dis_loss(logp, torch.tensor([[0.0, float("nan"), 0.0]]), torch.ones(1), mask)
    with pytest.raises(ValueError):
        importance_sampling_loss(logp, None, torch.ones(1), mask)
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, None, torch.ones(1), mask)
    with pytest.raises(ValueError):
        dis_loss(logp, logp, torch.ones(1), mask, eps_low=1.0)


def test_critic_loss_ignores_observation_tokens():
    returns = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    values = GAE_VALUES.clone().requires_grad_()
    loss = critic_loss(values, returns, GAE_MASK)
    close(loss, ((0.8**2) + (0.7**2) + (0.6**2) + (0.5**2)) / 4)
    loss.backward()
    assert torch.all(values.grad[2:4] == 0)
    assert torch.all(values.grad[GAE_MASK.bool()] != 0)
    moved = GAE_VALUES.clone()
    moved[2:4] = 100.0
    close(critic_loss(moved, returns, GAE_MASK), loss.detach())


def test_explained_variance():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0])
    m = torch.ones(4)
    assert explained_variance(r, r, m) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(4) + r.mean(), r, m) == pytest.approx(0.0)
    assert math.isnan(explained_variance(r, torch.ones(4), m))


# --------------------------------------------------------------------------- TTT-Discover


@pytest.mark.parametrize(
    "rewards, beta, advantages",
    [
        ([0, 0, 0, 1], 2.55324, [-0.797963, -0.797963, -0.797963, 11.848733]),
        ([1, 0, 0, 0, 0, 0, 0, 0], 2.46539, [10.768051] + [-0.606034] * 7),
        ([0.1, 0.2, 0.3, 0.4], 14.4586, [-0.969633, -0.866698, -0.338701, 8.865418]),
    ],
)
def test_entropic_adaptive_beta_golden(rewards, beta, advantages):
    b, a = entropic_adaptive_beta_loo(torch.tensor(rewards, dtype=torch.float32))
    assert a.dtype == torch.float32
    assert float(b) == pytest.approx(beta, rel=1e-4)
    close(a, advantages)
    # the solved β hits the target KL(q_β ‖ uniform) = ln 2
    r = torch.tensor(rewards, dtype=torch.float64)
    q = torch.softmax(float(b) * (r - r.max()), 0)
    assert float((q * torch.log(len(rewards) * q)).sum()) == pytest.approx(math.log(2), abs=1e-6)


def test_entropic_shift_and_scale_invariance():
    b, a = entropic_adaptive_beta_loo(torch.tensor([2.60, 2.61, 2.62, 2.63]))
    assert float(b) == pytest.approx(144.584, rel=1e-4)
    close(a, [-0.969633, -0.866698, -0.338701, 8.865418], atol=1e-4)
    _, scaled = entropic_adaptive_beta_loo(torch.tensor([0.1, 0.2, 0.3, 0.4]) * 7 - 3)
    close(scaled, [-0.969633, -0.866698, -0.338701, 8.865418], atol=1e-4)


def test_entropic_edge_cases():
    b, a = entropic_adaptive_beta_loo(torch.tensor([1.0, 1.0, 0.0, 0.0]))
    close(a, [2, 2, -1, -1])
    b, a = entropic_adaptive_beta_loo(torch.tensor([0.3, 0.3, 0.3]))
    assert float(b) == 1_048_576.0  # cap reached, no bisection
    assert torch.all(a == 0)
    b, a = entropic_adaptive_beta_loo(torch.tensor([0.0, 1.0]))  # degenerate k = 2 (§5.6)
    close(a[0], -1.0)
    assert float(a[1]) == pytest.approx(1e12, rel=1e-3)
    b, a = entropic_adaptive_beta_loo(torch.tensor([5.0]))
    assert float(b) == 0.0 and float(a[0]) == 0.0
    with pytest.raises(ValueError, match="finite"):
        entropic_adaptive_beta_loo(torch.tensor([0.0, float("nan"), 1.0]))


def test_entropic_batched_groups_match_single():
    groups = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.1, 0.2, 0.3, 0.4]])
    betas, advs = entropic_adaptive_beta_loo(groups)
    assert betas.shape == (2,) and advs.shape == (2, 4)
    for g in range(2):
        b, a = entropic_adaptive_beta_loo(groups[g])
        assert float(betas[g]) == float(b)
        assert torch.equal(advs[g], a)


def test_centered_kl_advantages_use_the_batch_mean():
    sampled = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    base = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, mean_diff = centered_kl_advantages(torch.tensor([1.0, -1.0]), sampled, base, mask, kl_coef=0.1)
    d_bar = 0.5 / 5
    assert mean_diff == pytest.approx(d_bar)
    expected = [
        [1 + 0.1 * (d_bar - 0.5), 1 + 0.1 * d_bar, 1 + 0.1 * (d_bar + 1)],
        [-1 + 0.1 * d_bar, -1 + 0.1 * (d_bar - 1), -1],  # the masked token keeps its advantage
    ]
    close(adv, expected)


def test_importance_sampling_loss_is_an_unclipped_token_sum():
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    sampler = torch.tensor([[-1.0, -2.5, -2.0]])  # ratio e^2 on token 1: far outside any PPO clip
    adv = torch.tensor([[1.0, 1.0, 3.0]])
    loss = importance_sampling_loss(logp, sampler, adv, torch.tensor([[1, 1, 0]]))
    close(loss, -(1.0 + math.exp(2.0)))
    loss.backward()
    close(logp.grad, [[-1.0, -math.exp(2.0), 0.0]])


# --------------------------------------------------------------------------- OPD and helpers


def test_opd_advantage_clips_and_vanishes_for_identical_teacher():
    teacher = torch.tensor([-0.1, -3.0, -1.0, -2.0])
    rollout = torch.tensor([-2.0, -0.5, -1.0, -1.5])
    close(opd_advantage(teacher, rollout), [1.0, -1.0, 0.0, -0.5])
    close(opd_advantage(teacher, rollout, clip=None), [1.9, -2.5, 0.0, -0.5])
    logp = rollout.clone().requires_grad_()
    loss, _ = ppo_clip_loss(logp, rollout, opd_advantage(rollout, rollout), torch.ones(4))
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_gather_logprobs_and_masked_mean():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 7)
    ids = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    close(gather_logprobs(logits, ids), expected)
    x = torch.tensor([1.0, float("inf"), 3.0])
    close(masked_mean(x, torch.tensor([1, 0, 1])), 2.0)
    close(masked_mean(x, torch.zeros(3)), 0.0)
