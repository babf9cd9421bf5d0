"""TTT-Discover's objective: entropic LOO advantages, a centred KL to the frozen base, un-clipped importance sampling.

Per group (the samples' ``group_key``, ``"<step>:<group>"`` from the grid barrier) the advantage ``A_i`` comes from
:func:`reef_ttt.advantages.group_advantages` (default: entropic adaptive-β leave-one-out) and is broadcast to every
action token of rollout ``i``. With ``kl_coef > 0`` the KL to the base is folded in, centred over the whole batch::

    d_t = logπ_rollout(a_t) − logπ_base(a_t)        d̄ = Σ d / Σ mask (the whole batch)
    A_t = A_i + kl_coef · (d̄ − d_t)

The loss is importance sampling against the engine's rollout log-probs, with no clipping and no averaging::

    L = − Σ_tokens exp(logπ_θ(a_t) − logπ_rollout(a_t)) · A_t

one optimizer step for the whole grid (the trainer backend steps once per batch). The base is the scenario's
frozen start (``needs_reference``): with LoRA the policy with its adapter disabled, so no second copy is held.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reef_core.api import Objective, Prepared, TokenBatch, centered_kl_advantages, sequence_logprobs, token_sum

from reef_ttt.advantages import group_advantages


class TTTObjective(Objective):
    """See the module docstring."""

    name = "ttt"
    slime_loss = "ttt_loss"

    def __init__(self, *, advantage: str = "entropic_adaptive_beta", kl_coef: float = 0.1, learn: bool = True):
        self.advantage = advantage
        self.kl_coef = float(kl_coef)
        self.learn = learn
        self.needs_reference = self.kl_coef > 0
        self.steps = 0

    def groups(self, batch: TokenBatch) -> list[list[int]]:
        """Row indices per group key (rows without a key form one group each)."""
        order: dict[Any, list[int]] = {}
        for i, key in enumerate(batch.group_keys):
            order.setdefault(key if key is not None else ("row", i), []).append(i)
        return list(order.values())

    def sample_advantages(self, batch: TokenBatch) -> tuple[Tensor, list[float]]:
        rewards = batch.rewards.detach().float().cpu()
        adv = torch.zeros_like(rewards)
        betas = []
        for rows in self.groups(batch):
            values, beta = group_advantages(rewards[rows], self.advantage)
            adv[rows] = values
            betas.append(beta)
        return adv, betas

    def reference_logprobs(self, batch: TokenBatch) -> Tensor:
        """``[B, L]`` base log-probs, computed micro-batch by micro-batch (bounded memory)."""
        parts = []
        for micro in batch.split(getattr(self, "micro_batches", 1)):
            lp = self.reference.logprobs(micro)
            parts.append(F.pad(lp, (0, batch.seq_len - lp.shape[1])))
        return torch.cat(parts).to(batch.device)

    def prepare(self, policy: nn.Module, batch: TokenBatch) -> Prepared:
        adv, betas = self.sample_advantages(batch)
        mask = batch.action_mask.float()
        per_token = adv.to(batch.device).unsqueeze(1) * mask
        metrics: dict[str, float] = {
            "ttt/groups": float(len(betas)),
            "ttt/beta_mean": sum(betas) / max(len(betas), 1),
            "ttt/advantage_abs_max": float(adv.abs().max()) if adv.numel() else 0.0,
        }
        if self.kl_coef > 0:
            per_token, d_mean = centered_kl_advantages(per_token, batch.rollout_logprobs,
                                                       self.reference_logprobs(batch), mask, self.kl_coef)
            metrics["ttt/kl_to_base"] = d_mean
        if not self.learn:  # the control arm: a zero gradient, so Adam (no weight decay) leaves the weights as they are
            per_token = torch.zeros_like(per_token)
        self.steps += 1
        return Prepared(batch=batch.with_extras(advantages=per_token), metrics=metrics)

    def loss(self, policy: nn.Module, batch: TokenBatch, prepared: Prepared) -> tuple[Tensor, dict[str, float]]:
        logp = sequence_logprobs(policy, batch)
        mask = batch.action_mask > 0
        log_ratio = torch.where(mask, logp - batch.rollout_logprobs, torch.zeros_like(logp))
        ratio = torch.exp(log_ratio)
        adv = batch.extras["advantages"].to(logp.dtype)
        loss = -token_sum(ratio * adv, mask)
        with torch.no_grad():
            sums = {"tokens": float(mask.sum()), "ratio_sum": float(token_sum(ratio, mask)),
                    "neg_log_ratio_sum": float(token_sum(-log_ratio, mask)),
                    "advantage_sum": float(token_sum(adv, mask))}
        return loss, sums

    def summarize(self, prepared: Prepared, sums: dict[str, float]) -> dict[str, float]:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        return {"ttt/tokens": sums.get("tokens", 0.0), "ratio_mean": sums.get("ratio_sum", 0.0) / tokens,
                "approx_kl": sums.get("neg_log_ratio_sum", 0.0) / tokens,
                "advantage_mean": sums.get("advantage_sum", 0.0) / tokens}

    def slime_header(self, batch: TokenBatch) -> dict[str, Any]:
        """The slime hook's scale: this loss is a plain token sum (normaliser 1)."""
        return {**super().slime_header(batch), "loss_norm": 1.0}

    def json_state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_json_state(self, state: dict[str, Any] | None) -> None:
        self.steps = int((state or {}).get("steps", 0) or 0)

