"""Training losses and advantage estimators shared by the weight recipes (pure torch).

This module imports torch and the standard library only, never anything else of ``reef_core``: ``reef_slime_hooks``
(which runs inside slime's processes without the ``reef_core`` package) loads it by its path, so the slime hooks and
the torch backend's objectives share one implementation of each term (:func:`gather_logprobs`, :func:`dis_weight`,
:func:`clipped_surrogate`).

Every function works on plain tensors so a recipe can run it on CPU with a tiny model and on a
GPU with a real one. Shape conventions: ``[B, T]`` for per-token tensors (``B`` samples,
``T`` response positions), ``[B]`` for per-sample tensors; ``mask`` selects the tokens a loss
trains on (1 = model token). Formulas follow the recipe reference (SAO §3, TTT-Discover §5,
OPD §9.2, the GRPO probe arm §11); the golden vectors of §12 are the unit tests.

What is here has callers outside the tests (the objectives, through ``reef_core.api``, and the slime hooks). The
recipe reference's token-mean losses (PPO's clipped loss, DIS, TTT's importance sampling, the critic's MSE, the
sampled-token OPD advantage) have none: every objective scales its loss by the whole batch's normalisers instead.
They live with their golden vectors in ``tests/grow/test_losses.py``, built on the terms defined here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# TTT-Discover's adaptive-β search constants (target KL ln 2, cap 1e6, 60 bisection steps).
ENTROPIC_TARGET_KL = math.log(2.0)
_ENTROPIC_BETA_CAP = 1e6
_ENTROPIC_BISECT_ITERS = 60
_ENTROPIC_EPS = 1e-12


# --------------------------------------------------------------------------- helpers


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (NaN/inf outside the mask are ignored)."""
    m = mask.to(torch.bool)
    return torch.where(m, x, torch.zeros_like(x)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the masked positions; 0 (still differentiable) when the mask is empty."""
    count = mask.to(x.dtype).sum()
    return masked_sum(x, mask) / count.clamp(min=1.0)


def gather_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Full-vocabulary log-probability of each ``token_ids`` entry: ``logit - logsumexp(logits)``.

    ``logits`` is ``[..., V]`` aligned with ``token_ids`` ``[...]`` (shift before calling: the
    logits at position t score the token at t + 1). Computed in float32 for stability.
    """
    logits = logits.float()
    picked = logits.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """Broadcast per-sample advantages ``[B]`` to ``like``'s ``[B, T]``; per-token ones pass through."""
    if advantages.dim() == like.dim():
        return advantages
    if advantages.dim() == like.dim() - 1:
        return advantages.unsqueeze(-1).expand_as(like)
    raise ValueError(
        f"advantages must be per sample {tuple(like.shape[:-1])} or per token {tuple(like.shape)},"
        f" got {tuple(advantages.shape)}"
    )


# --------------------------------------------------------------------------- GRPO / PPO


def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = False, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages: ``r - mean(r)`` within consecutive groups of ``group_size``.

    With ``normalize_std`` the centred reward is divided by ``std + eps`` (unbiased std, as in
    TRL's GRPO). The probe's GRPO arm and the SAO control arm use no normalisation.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    flat = rewards.reshape(-1)
    if flat.numel() % group_size:
        raise ValueError(f"{flat.numel()} rewards do not split into groups of {group_size}")
    groups = flat.view(-1, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(adv)
        adv = adv / (std + eps)
    return adv.reshape(rewards.shape)


def clipped_surrogate(advantage: Tensor, ratio: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's pessimistic surrogate ``max(−A·ρ, −A·clip(ρ, 1 − eps_low, 1 + eps_high))`` elementwise (no mask, no
    reduction): the per-token term of :func:`ppo_clip_loss`, OpenClaw's RL and OPD terms and its slime hook."""
    return torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))


# --------------------------------------------------------------------------- SAO


def length_adaptive_lambda(length: float, alpha: float = 1.5) -> float:
    """SAO's actor λ for a response of ``length`` tokens: ``clamp(1 - 1/(alpha·length), 0, 1)``.

    ``length`` is the whole response span, observation tokens included.
    """
    denom = alpha * float(length)
    if denom <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - 1.0 / denom))


def skip_observation_gae(
    values: Tensor,
    action_mask: Tensor,
    reward: Tensor | float,
    gamma: float = 1.0,
    lam: float | Tensor = 1.0,
) -> tuple[Tensor, Tensor]:
    """Skip-observation GAE (SAO §3.2). Returns ``(advantages, returns)`` shaped like ``values``.

    ``values``/``action_mask`` are ``[T]`` (one sample, scalar ``reward``) or ``[B, T]`` (``reward``
    ``[B]``; ``lam`` a float or per-sample ``[B]``). The scalar reward sits on the last action
    token; the recursion walks action tokens only, so ``V_next`` of an action's last token is the
    value of the first token of the *next action*, bridging the observation span. Observation
    (and padding) tokens get advantage 0 and return 0 and never enter the recurrence.
    """
    single = values.dim() == 1
    v = values.detach().double()
    am = action_mask.to(torch.bool)
    if single:
        v, am = v.unsqueeze(0), am.unsqueeze(0)
    if v.shape != am.shape or v.dim() != 2:
        raise ValueError(f"values {tuple(values.shape)} and action_mask {tuple(action_mask.shape)} must match")
    batch, length = v.shape
    r = torch.as_tensor(reward).detach().to(torch.float64).reshape(-1).expand(batch)
    lam_t = torch.as_tensor(lam).detach().to(torch.float64).reshape(-1).expand(batch)

    adv = torch.zeros_like(v)
    next_value = torch.zeros(batch, dtype=torch.float64)
    next_adv = torch.zeros(batch, dtype=torch.float64)
    seen_action = torch.zeros(batch, dtype=torch.bool)  # False until the last action token (from the back)
    for t in range(length - 1, -1, -1):
        act = am[:, t]
        r_t = torch.where(act & ~seen_action, r, torch.zeros_like(r))
        delta = r_t + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam_t * next_adv
        adv[:, t] = torch.where(act, a_t, torch.zeros_like(a_t))
        next_value = torch.where(act, v[:, t], next_value)
        next_adv = torch.where(act, a_t, next_adv)
        seen_action = seen_action | act
    returns = torch.where(am, adv + v, torch.zeros_like(v))
    if single:
        adv, returns = adv.squeeze(0), returns.squeeze(0)
    dtype = values.dtype if values.is_floating_point() else torch.float32
    return adv.to(dtype), returns.to(dtype)


def dis_weight(ratio: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """DIS band weight: ``r`` if ``1 - eps_low < r < 1 + eps_high`` (strict) else exactly 0."""
    inside = (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over masked tokens (``nan`` when the returns are constant)."""
    with torch.no_grad():
        m = mask.to(torch.bool)
        v, r = values[m].double(), returns[m].double()
        if r.numel() < 2:
            return float("nan")
        var_r = r.var(unbiased=False)
        if var_r == 0:
            return float("nan")
        return float(1.0 - (r - v).var(unbiased=False) / var_r)


# --------------------------------------------------------------------------- TTT-Discover


def entropic_kl(rewards: Tensor, beta: float) -> float:
    """``KL(q_β ‖ uniform)`` of one group, ``q_β ∝ exp(β (r - max r))``, in float32 (as upstream)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    logits = r.new_tensor(beta) * (r - r.max())
    log_q = logits - torch.logsumexp(logits, dim=0)
    return float((torch.exp(log_q) * (log_q + math.log(r.numel()))).sum())


def entropic_beta(rewards: Tensor) -> float:
    """The adaptive β of one group: ``KL(q_β ‖ uniform) = ln 2`` (:func:`entropic_kl`), found by doubling from 1
    (cap 1e6, i.e. 2^20 = 1,048,576 when never reached: a constant group) then 60 bisection steps; 0.0 for a group
    of fewer than two rewards."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if r.numel() < 2:
        return 0.0
    lo, hi = 0.0, 1.0
    bisect = True
    if entropic_kl(r, hi) < ENTROPIC_TARGET_KL:
        while hi < _ENTROPIC_BETA_CAP and entropic_kl(r, hi) < ENTROPIC_TARGET_KL:
            hi *= 2.0
        # Cap reached without hitting the target (e.g. a constant group): keep the cap, no bisection.
        bisect = entropic_kl(r, hi) >= ENTROPIC_TARGET_KL
    if bisect:
        for _ in range(_ENTROPIC_BISECT_ITERS):
            mid = 0.5 * (lo + hi)
            if entropic_kl(r, mid) < ENTROPIC_TARGET_KL:
                lo = mid
            else:
                hi = mid
    return hi


def entropic_loo(rewards: Tensor, beta: float) -> Tensor:
    """Leave-one-out entropic advantages of one group at ``beta`` (float32): ``A_i = e_i / (mean_{j≠i} e_j + 1e-12)
    - 1`` with ``e_i = exp(β (r_i - max r))``; zeros for a group of fewer than two rewards."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    k = r.numel()
    if k < 2:
        return torch.zeros_like(r)
    e = torch.exp(r.new_tensor(beta) * (r - r.max()))
    z = (e.sum() - e) / (k - 1)  # leave-one-out mean of the other samples' weights
    return e / (z + _ENTROPIC_EPS) - 1.0


def _entropic_group(r: Tensor) -> tuple[Tensor, Tensor]:
    if r.shape[0] < 2:
        return r.new_tensor(0.0), torch.zeros_like(r)
    beta = entropic_beta(r)
    return r.new_tensor(beta), entropic_loo(r, beta)


def entropic_adaptive_beta_loo(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """TTT-Discover's entropic adaptive-β leave-one-out advantages (float32, as upstream).

    ``rewards`` is one group ``[k]`` or groups ``[G, k]``; returns ``(beta, advantages)`` with
    ``beta`` a 0-d tensor (or ``[G]``) and advantages shaped like ``rewards``: per group, β is
    :func:`entropic_beta` and the advantages :func:`entropic_loo` at it. Invariant to ``r → a·r + b``
    (a > 0); k < 2 gives β = 0, A = 0; non-finite rewards are refused.
    """
    r = torch.as_tensor(rewards).detach().to(torch.float32)
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    if r.dim() == 1:
        return _entropic_group(r)
    if r.dim() != 2:
        raise ValueError(f"rewards must be [k] or [G, k], got {tuple(r.shape)}")
    betas, advs = zip(*(_entropic_group(row) for row in r))
    return torch.stack(betas), torch.stack(advs)


def centered_kl_advantages(
    advantages: Tensor, sampled_logp: Tensor, base_logp: Tensor, mask: Tensor, kl_coef: float
) -> tuple[Tensor, float]:
    """Fold a centred KL-to-base penalty into per-token advantages (TTT-Discover §5.2 step 7).

    ``d_t = sampled_logp - base_logp`` on masked tokens, ``d̄`` its mean over the *whole batch*;
    returns ``(A_t + kl_coef·(d̄ - d_t) on masked tokens, d̄)``. ``advantages`` is ``[B]`` or ``[B, T]``.
    """
    m = mask.to(torch.bool)
    adv = _per_token(advantages, sampled_logp).to(sampled_logp.dtype)
    diff = torch.where(m, sampled_logp - base_logp, torch.zeros_like(sampled_logp))
    mean_diff = masked_mean(diff, m)
    penalty = torch.where(m, kl_coef * (mean_diff - diff), torch.zeros_like(diff))
    return (adv + penalty).detach(), float(mean_diff)

