"""OpenClaw-RL's loss: ``w_rl * L_RL + w_opd * L_OPD`` (arXiv:2603.10165; reef's ``recipes/openclawrl``).

``L_RL``: PPO's clipped surrogate on the sampled tokens, the turn's reward (±1 from the judge) broadcast over its
reply; ``ρ = exp(clamp(logπ_θ − logπ_rollout, −20, 20))`` against the engine's captured log-probs, per token
``max(−Aρ, −A·clip(ρ, 1 − ε, 1 + ε_h))``, mean over the batch's action tokens.

``L_OPD`` (top-K on-policy distillation, subset = the student's top-K set ``S_t`` captured by the engine): the frozen
base (the teacher) scores the student's exact tokens after the prompt with a hint appended to the last user message
(or after the plain prompt for a turn judged without a hint: the "anchor"). Per action token and ``v ∈ S_t``::

    ℓ_old(v) = the current policy's log-prob of v, detached     (reef's choice: ρ ≡ 1 for one step per rollout)
    w_v      = softmax over S_t of ℓ_old                          (detached)
    A_v      = clip(ℓ_T(v) − ℓ_old(v), −c, c) · w_v               (c = adv_diff_clip, 1.0)
    ρ_v      = exp(ℓ_θ(v) − ℓ_old(v))
    loss_t   = Σ_{v ∈ S_t} max(−A_v ρ_v, −A_v clip(ρ_v, 1 − ε, 1 + ε_h))

mean over the tokens OPD covers. All ℓ are full-vocabulary log-probs. With several hint candidates the teacher is the
candidate whose own top-K sets overlap the student's most over the reply (``sequence_optimal``), per token
(``token_optimal``), or the shortest hint (``shortest``). A row OPD covers needs top-K data on every action token.

Per-row inputs come as ``batch.extras`` (attached by :class:`reef_openclaw.trainer.OpenClawTrainer`):
``openclaw_teacher`` ``[B]`` (0 none, 1 frozen base after the plain prompt, 2 after a hinted prompt),
``openclaw_hint_ids`` ``[B, H, P]`` and ``openclaw_hint_lens`` ``[B, H]`` (the hinted prompts' token ids, shortest
hint first; length 0 = no candidate).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

# clipped_surrogate: PPO's pessimistic surrogate max(−Aρ, −A·clip(ρ, 1 − ε, 1 + ε_h)) elementwise, the core's
# (the same term the slime hook trains with)
from reef_core.api import ConfigError, Objective, Prepared, TokenBatch, action_logits, clipped_surrogate, token_sum

from reef_openclaw.options import HINT_SELECTIONS

TEACHER_NONE, TEACHER_BASE, TEACHER_HINT = 0, 1, 2
_HINT_KEYS = ("openclaw_hint_ids", "openclaw_hint_lens")


def opd_advantages(teacher_logprobs: Tensor, old_logprobs: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """``(A, w)`` over the last dimension (the student's top-K set): ``w = softmax(ℓ_old)``,
    ``A = clip(ℓ_T − ℓ_old, −clip, clip) · w``; both detached, so ``|A| ≤ clip · w``."""
    old = old_logprobs.detach()
    weight = torch.softmax(old, dim=-1)
    diff = (teacher_logprobs.detach() - old).clamp(-clip, clip)
    return diff * weight, weight


def select_teacher(student_ids: Tensor, teacher_top: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Index of the hint candidate per row (``[B]``, sequence modes) or per token (``[B, L]``, ``token_optimal``).

    ``student_ids`` ``[B, L, K]``; ``teacher_top`` ``[H, B, L, K]`` (each candidate's own top-K ids, ``-1`` where a
    row lacks the candidate); ``mask`` ``[B, L]`` (action tokens with top-K data). Overlap ``|S_t ∩ S^p_{t,h}|``;
    ties go to the lower index (the shorter hint)."""
    overlap = (teacher_top.unsqueeze(-1) == student_ids.unsqueeze(0).unsqueeze(-2)).any(dim=-1).sum(dim=-1)
    overlap = overlap.float() * mask.unsqueeze(0)  # [H, B, L]
    absent = (teacher_top[..., 0] < 0).all(dim=-1)  # [H, B]: the row has no candidate h
    if mode == "shortest":
        return torch.zeros(student_ids.shape[0], dtype=torch.long, device=student_ids.device)
    if mode == "token_optimal":
        overlap = overlap.masked_fill(absent.unsqueeze(-1), -1.0)
        return overlap.argmax(dim=0)  # first maximum: the shortest hint among the best
    total = overlap.sum(dim=-1).masked_fill(absent, -1.0)  # [H, B]
    return total.argmax(dim=0)


class OpenClawObjective(Objective):
    """``w_rl * L_RL + w_opd * L_OPD`` (see the module docstring)."""

    name = "openclaw"
    slime_loss = "openclaw_loss"
    needs_reference = True

    def __init__(self, *, w_rl: float = 1.0, w_opd: float = 1.0, eps_clip: float = 0.2, eps_clip_high: float = 0.28,
                 adv_diff_clip: float = 1.0, hint_selection: str = "sequence_optimal"):
        for name, value in (("w_rl", w_rl), ("w_opd", w_opd), ("eps_clip", eps_clip),
                            ("eps_clip_high", eps_clip_high), ("adv_diff_clip", adv_diff_clip)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"openclaw: {name} must be a finite non-negative number, got {value!r}")
        if eps_clip >= 1.0:
            raise ConfigError(f"openclaw: eps_clip must lie in [0, 1), got {eps_clip}")
        if adv_diff_clip == 0:
            raise ConfigError("openclaw: adv_diff_clip must be positive (0 would silence the teacher)")
        if hint_selection not in HINT_SELECTIONS:
            raise ConfigError(f"openclaw: hint_selection must be one of {', '.join(HINT_SELECTIONS)}, "
                              f"got {hint_selection!r}")
        self.w_rl, self.w_opd = float(w_rl), float(w_opd)
        self.eps_low, self.eps_high = float(eps_clip), float(eps_clip_high)
        self.adv_diff_clip = float(adv_diff_clip)
        self.hint_selection = hint_selection

    # -- trainer.backend=slime (the RL half only) ------------------------------------------------------------------

    def check_slime(self) -> None:
        if self.w_opd > 0:
            raise ConfigError("trainer.backend=slime: openclaw's OPD term (w_opd > 0) needs each token's top-K teacher "
                              "scores, which slime's training batch has no place for; set w_opd: 0 or use "
                              "trainer.backend=torch")

    def slime_advantages(self, prepared: Prepared) -> Tensor:
        """L_RL's advantage: the turn's reward over its reply."""
        batch = prepared.batch
        return batch.rewards.unsqueeze(1) * batch.action_mask

    def slime_header(self, batch: TokenBatch) -> dict[str, Any]:
        return {**super().slime_header(batch), "w_rl": float(self.w_rl)}

    # -- the teacher (no policy gradient) -------------------------------------------------------------------------

    def prepare(self, policy: nn.Module, batch: TokenBatch) -> Prepared:
        extras = dict(batch.extras)
        hint_ids, hint_lens = extras.pop(_HINT_KEYS[0], None), extras.pop(_HINT_KEYS[1], None)
        batch = replace(batch, extras=extras)
        teacher = extras.get("openclaw_teacher")
        if teacher is None:
            teacher = torch.zeros(batch.size, dtype=torch.long, device=batch.device)
        action = batch.action_mask > 0
        metrics = {"opd/rows_hint": float((teacher == TEACHER_HINT).sum()),
                   "opd/rows_base": float((teacher == TEACHER_BASE).sum())}
        covered = torch.zeros(batch.size, dtype=torch.bool, device=batch.device)
        teacher_lp = None
        if self.w_opd > 0 and batch.top_k_ids is not None and bool((teacher > 0).any()):
            complete = ((batch.top_k_mask > 0) | ~action).all(dim=1)  # top-K on every action token
            covered = (teacher > 0) & complete
            metrics["opd/rows_missing_top_k"] = float(((teacher > 0) & ~complete).sum())
            teacher_lp = self._teacher_logprobs(batch, teacher, hint_ids, hint_lens, covered, metrics)
        mask = action & covered.unsqueeze(1)
        opd_tokens = int(mask.sum())
        if teacher_lp is None:
            teacher_lp = torch.zeros((batch.size, batch.seq_len, 1), device=batch.device)
        batch = batch.with_extras(openclaw_teacher_logprobs=teacher_lp,
                                  openclaw_opd_rows=covered.to(torch.float32))
        metrics["opd/rows"] = float(covered.sum())
        metrics["opd/tokens"] = float(opd_tokens)
        return Prepared(batch=batch, metrics=metrics, data={"opd_tokens": opd_tokens})

    def _teacher_logprobs(self, batch: TokenBatch, teacher: Tensor, hint_ids: Tensor | None,
                          hint_lens: Tensor | None, covered: Tensor, metrics: dict) -> Tensor:
        """``[B, L, K]``: the teacher's log-probs of the student's top-K ids at every position."""
        ids = batch.top_k_ids
        k = ids.shape[-1]
        base = self.reference.score(batch, token_ids=ids)
        result = base.token_logprobs
        hinted = covered & (teacher == TEACHER_HINT)
        if hint_ids is None or not bool(hinted.any()):
            return result
        per_hint, tops = [], []
        for h in range(hint_ids.shape[1]):
            # only the rows holding an h-th hint are scored; the base's scores stay in the other rows
            rows = torch.nonzero(hinted & (hint_lens[:, h] > 0)).flatten().tolist()
            logprobs, top = result.clone(), torch.full_like(ids, -1)
            if rows:
                sub = batch.select(rows)
                prompts = [hint_ids[b, h, :int(hint_lens[b, h])].tolist() for b in rows]
                scored = self.reference.score(sub, prompts, token_ids=sub.top_k_ids, top_k=k)
                logprobs[rows, :sub.seq_len] = scored.token_logprobs
                top[rows, :sub.seq_len] = scored.top_k_ids
            per_hint.append(logprobs)
            tops.append(top)
        mask = (batch.action_mask > 0) & (batch.top_k_mask > 0)
        choice = select_teacher(ids, torch.stack(tops), mask.float(), self.hint_selection)
        stacked = torch.stack(per_hint)  # [H, B, L, K]
        if choice.dim() == 1:
            chosen = stacked[choice, torch.arange(batch.size, device=choice.device)]
        else:
            index = choice.unsqueeze(0).unsqueeze(-1).expand(1, *choice.shape, k)
            chosen = stacked.gather(0, index).squeeze(0)
        metrics["opd/hint_index_mean"] = float(choice.float()[hinted].mean())
        return torch.where(hinted.view(-1, 1, 1), chosen, result)

    # -- the loss ---------------------------------------------------------------------------------------------

    def loss(self, policy: nn.Module, batch: TokenBatch, prepared: Prepared) -> tuple[Tensor, dict[str, float]]:
        first, logits = action_logits(policy, batch)
        # log-probs computed exactly as the reference computes the teacher's (logit − logsumexp), so a teacher equal
        # to the student gives bit-identical values and exactly zero OPD gradient
        logits = logits.float()
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, L - first, 1]
        action = batch.action_mask[:, first:] > 0
        sampled = (logits.gather(-1, batch.input_ids[:, first:].unsqueeze(-1)) - norm).squeeze(-1)
        rollout = batch.rollout_logprobs[:, first:]
        log_ratio = torch.where(action, sampled - rollout, torch.zeros_like(sampled)).clamp(-20.0, 20.0)
        ratio = torch.exp(log_ratio)
        reward = batch.rewards.to(sampled.dtype).unsqueeze(1).expand_as(sampled)
        rl_tokens = clipped_surrogate(reward, ratio, self.eps_low, self.eps_high)
        loss_rl = token_sum(rl_tokens, action) / max(batch.norm_tokens, 1)

        opd_mask = action & (batch.extras["openclaw_opd_rows"].unsqueeze(1) > 0)
        sums: dict[str, float] = {}
        if batch.top_k_ids is not None and bool(opd_mask.any()):
            ids = batch.top_k_ids[:, first:]
            current = logits.gather(-1, ids) - norm  # [B, L', K]
            adv, weight = opd_advantages(batch.extras["openclaw_teacher_logprobs"][:, first:], current,
                                         self.adv_diff_clip)
            opd_ratio = torch.exp(current - current.detach())
            opd_tokens = clipped_surrogate(adv, opd_ratio, self.eps_low, self.eps_high).sum(dim=-1)
            loss_opd = token_sum(opd_tokens, opd_mask) / max(prepared.data.get("opd_tokens", 0), 1)
            with torch.no_grad():
                sums["opd_adv_abs_sum"] = float(token_sum(adv.abs().sum(-1), opd_mask))
                gap = (batch.extras["openclaw_teacher_logprobs"][:, first:] - current).detach()
                sums["opd_gap_sum"] = float(token_sum((gap * weight).sum(-1), opd_mask))
                drift = (current.detach() - batch.top_k_logprobs[:, first:]).abs().mean(-1)
                sums["opd_capture_drift_sum"] = float(token_sum(drift, opd_mask))
        else:
            loss_opd = logits.new_zeros(())
        loss = self.w_rl * loss_rl + self.w_opd * loss_opd
        with torch.no_grad():
            sums.update({"tokens": float(action.sum()), "opd_tokens": float(opd_mask.sum()),
                         "loss_rl": float(loss_rl), "loss_opd": float(loss_opd),
                         "clipped": float((action & (ratio.clamp(1 - self.eps_low, 1 + self.eps_high) != ratio)).sum()),
                         "neg_log_ratio_sum": float(token_sum(-log_ratio, action))})
        return loss, sums

    def summarize(self, prepared: Prepared, sums: dict[str, float]) -> dict[str, float]:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        opd = max(sums.get("opd_tokens", 0.0), 1.0)
        out: dict[str, Any] = {
            "loss_rl": sums.get("loss_rl", 0.0), "loss_opd": sums.get("loss_opd", 0.0),
            "pg_clipfrac": sums.get("clipped", 0.0) / tokens,
            "approx_kl": sums.get("neg_log_ratio_sum", 0.0) / tokens,
            "w_rl": self.w_rl, "w_opd": self.w_opd,
        }
        if sums.get("opd_tokens"):
            out["opd_advantage_abs_mean"] = sums.get("opd_adv_abs_sum", 0.0) / opd
            out["opd_teacher_gap_mean"] = sums.get("opd_gap_sum", 0.0) / opd
            out["opd_capture_vs_actor_logp_abs_mean"] = sums.get("opd_capture_drift_sum", 0.0) / opd
        return out
