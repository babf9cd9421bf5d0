"""SAO's objectives (arXiv:2607.07508): the SAO critic objective and the GRPO-with-DIS control arm.

Both train the policy with the DIS loss (direct double-sided importance sampling) against the *rollout* log-probs
the engine captured, never a recomputed old policy::

    r_t = exp(logπ_θ(a_t) − logπ_rollout(a_t))
    f(r) = r if 1 − ε_l < r < 1 + ε_h (strict) else 0
    ℓ_t = − sg(f(r_t)) · A_t · logπ_θ(a_t)          token mean over the batch's action tokens

They differ in the advantage ``A_t``:

* :class:`SAOObjective`: a separate value model (a copy of the policy body with a zero-initialised scalar head).
  Before each actor step it takes ``critic_steps_per_actor`` MSE steps toward λ_critic-returns (λ_critic = 1:
  Monte-Carlo returns), then the actor's advantages come from skip-observation GAE (γ = 1, the reward on the last
  action token, observation tokens skipped) with the length-adaptive ``λ = clamp(1 − 1/(α·l), 0, 1)``, using the
  values of the critic's last pass (as reef's slime bridge hands the critic's values to the actor).
* :class:`GRPODISObjective`: group-relative advantages ``r − mean(group)`` (no critic), broadcast to the action
  tokens; groups are the samples' ``group_key`` (grouped processor) or consecutive runs of ``group_size``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reef_core.api import (
    ConfigError,
    Objective,
    Prepared,
    TokenBatch,
    TrainerConfig,
    ValidationFailed,
    ValueModel,
    adamw,
    clipped_step,
    dis_weight,
    explained_variance,
    grpo_advantages,
    length_adaptive_lambda,
    sequence_logprobs,
    skip_observation_gae,
    token_sum,
)

from reef_sao.options import SAOOptions


def _pad_to(x: Tensor, width: int) -> Tensor:
    return F.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x


def _trained(module: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer steps: a LoRA critic's adapter and head, else every weight."""
    return [p for p in module.parameters() if p.requires_grad]


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ConfigError(f"sao: {name} must be a finite number, got {value!r}")
    return float(value)


class DISObjective(Objective):
    """The DIS policy loss shared by both arms; advantages come from ``batch.extras["advantages"]`` ``[B, L]``.

    ``eps_clip`` (ε_l) must lie in [0, 1); ``eps_clip_high`` (ε_h) must be given explicitly and be positive: an
    implicit ε_h would silently give a symmetric band, which is not SAO.
    """

    name = "dis"
    slime_loss = "dis_loss"

    def __init__(self, *, eps_clip: float, eps_clip_high: float | None):
        eps_low = _number("eps_clip", eps_clip)
        if not 0.0 <= eps_low < 1.0:
            raise ConfigError(f"sao: eps_clip must lie in [0, 1), got {eps_low}")
        if eps_clip_high is None:
            raise ConfigError("sao: eps_clip_high must be set explicitly (paper: 5.0 for reasoning, 3.0 for coding); "
                              "falling back to eps_clip would give a symmetric band, not SAO's trust region")
        eps_high = _number("eps_clip_high", eps_clip_high)
        if eps_high <= 0.0:
            raise ConfigError(f"sao: eps_clip_high must be positive, got {eps_high}")
        self.eps_low, self.eps_high = eps_low, eps_high

    def band_weight(self, ratio: Tensor) -> Tensor:
        """``f(r)``: the ratio inside the strict band ``(1 − ε_l, 1 + ε_h)``, exactly 0 outside."""
        return dis_weight(ratio, self.eps_low, self.eps_high)

    def token_loss(self, logp: Tensor, batch: TokenBatch) -> tuple[Tensor, dict[str, float]]:
        """DIS loss of ``logp`` ``[B, L]`` (the policy's log-probs of ``batch.input_ids``), scaled by the whole
        batch's action-token count, and additive metric sums."""
        mask = batch.action_mask > 0
        adv = batch.extras["advantages"].to(logp.dtype)
        with torch.no_grad():
            log_ratio = logp.detach() - torch.where(mask, batch.rollout_logprobs, logp.detach())
            ratio = torch.exp(log_ratio)
            weight = torch.where(mask, self.band_weight(ratio), torch.zeros_like(ratio))
        per_token = -weight * adv * logp
        loss = token_sum(per_token, mask) / max(batch.norm_tokens, 1)
        with torch.no_grad():
            sums = {
                "tokens": float(mask.sum()),
                "clipped": float((mask & (weight == 0)).sum()),
                "ratio_sum": float(token_sum(ratio, mask)),
                "neg_log_ratio_sum": float(token_sum(-log_ratio, mask)),
                "advantage_sum": float(token_sum(adv, mask)),
                "advantage_sq_sum": float(token_sum(adv * adv, mask)),
            }
        return loss, sums

    def loss(self, policy: nn.Module, batch: TokenBatch, prepared: Prepared) -> tuple[Tensor, dict[str, float]]:
        return self.token_loss(sequence_logprobs(policy, batch), batch)

    def summarize(self, prepared: Prepared, sums: dict[str, float]) -> dict[str, float]:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        mean_adv = sums.get("advantage_sum", 0.0) / tokens
        return {
            "pg_clipfrac": sums.get("clipped", 0.0) / tokens,
            "ratio_mean": sums.get("ratio_sum", 0.0) / tokens,
            "approx_kl": sums.get("neg_log_ratio_sum", 0.0) / tokens,
            "advantage_mean": mean_adv,
            "advantage_std": math.sqrt(max(sums.get("advantage_sq_sum", 0.0) / tokens - mean_adv ** 2, 0.0)),
        }


class SAOObjective(DISObjective):
    """SAO: critic (two timescales) + skip-observation GAE + DIS (see the module docstring).

    Args:
        eps_clip, eps_clip_high: the DIS band (ε_l, ε_h).
        critic_steps_per_actor: critic MSE steps before each actor step (paper 2).
        num_critic_only_steps: first steps that train the critic only (warm-up; no candidate).
        length_adaptive_lambda, lambda_alpha: actor λ = clamp(1 − 1/(α·l), 0, 1) per sample (paper on, α = 1.5);
            off: the fixed ``lam``.
        critic_lambda: λ of the critic's targets (paper 1.0: Monte-Carlo returns).
        gamma: discount (paper 1.0).
        critic_lr, critic_weight_decay, critic_max_grad_norm: the critic's AdamW and clipping.
        critic_lora: ``(rank, alpha, layers)`` trains the critic as a LoRA adapter (on its last ``layers`` layers;
            ``None``: every layer) over its frozen copy of the body, plus its full head; ``None`` (the paper) trains
            every weight of the critic.
    """

    name = "sao"
    slime_loss = "sao_loss"

    # Defaults are read from SAOOptions (and the trainer section for critic_lr), the knobs' one source.
    def __init__(self, *, eps_clip: float, eps_clip_high: float | None,
                 critic_steps_per_actor: int = SAOOptions.critic_steps_per_actor,
                 num_critic_only_steps: int = SAOOptions.num_critic_only_steps,
                 length_adaptive_lambda: bool = SAOOptions.length_adaptive_lambda,
                 lambda_alpha: float = SAOOptions.lambda_alpha, lam: float = SAOOptions.lam,
                 critic_lambda: float = SAOOptions.critic_lambda, gamma: float = SAOOptions.gamma,
                 critic_lr: float = TrainerConfig.critic_lr, critic_weight_decay: float = 0.0,
                 critic_max_grad_norm: float | None = SAOOptions.critic_max_grad_norm,
                 critic_lora: tuple[int, float, int | None] | None = None):
        super().__init__(eps_clip=eps_clip, eps_clip_high=eps_clip_high)
        if isinstance(critic_steps_per_actor, bool) or not isinstance(critic_steps_per_actor, int) \
                or critic_steps_per_actor < 1:
            raise ConfigError(f"sao: critic_steps_per_actor must be an integer >= 1, got {critic_steps_per_actor!r}")
        if isinstance(num_critic_only_steps, bool) or not isinstance(num_critic_only_steps, int) \
                or num_critic_only_steps < 0:
            raise ConfigError(f"sao: num_critic_only_steps must be an integer >= 0, got {num_critic_only_steps!r}")
        self.lambda_alpha = _number("lambda_alpha", lambda_alpha)
        if length_adaptive_lambda and self.lambda_alpha <= 0:
            raise ConfigError(f"sao: lambda_alpha must be positive, got {lambda_alpha}")
        self.lam = _number("lambda", lam)
        self.critic_lambda = _number("critic_lambda", critic_lambda)
        self.gamma = _number("gamma", gamma)
        for label, value in (("lambda", self.lam), ("critic_lambda", self.critic_lambda), ("gamma", self.gamma)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"sao: {label} must lie in [0, 1], got {value}")
        self.critic_lr = _number("critic_lr", critic_lr)
        if self.critic_lr <= 0:
            raise ConfigError(f"sao: critic_lr must be positive, got {critic_lr}")
        self.critic_steps_per_actor = critic_steps_per_actor
        self.num_critic_only_steps = num_critic_only_steps
        self.length_adaptive = bool(length_adaptive_lambda)
        self.critic_weight_decay = float(critic_weight_decay)
        self.critic_max_grad_norm = critic_max_grad_norm
        if critic_lora is not None and (isinstance(critic_lora[0], bool) or not isinstance(critic_lora[0], int)
                                        or critic_lora[0] < 1):
            raise ConfigError(f"sao: the critic's LoRA rank (trainer.lora_rank) must be a positive integer, got "
                              f"{critic_lora[0]!r}")
        self.critic_lora = critic_lora
        self.critic: ValueModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.batches = 0
        self.actor_steps = 0
        self.critic_updates = 0

    # -- setup and state ---------------------------------------------------------------------------------------

    def setup(self, policy, tokenizer, device, *, micro_batches: int = 1) -> None:
        super().setup(policy, tokenizer, device, micro_batches=micro_batches)
        rank, alpha, layers = self.critic_lora or (0, 0.0, None)
        self.critic = ValueModel.from_policy(policy, lora_rank=rank, lora_alpha=alpha,
                                             lora_layers=layers).to(self.device)
        self.critic.eval()  # no dropout in the value regression either
        self.critic_optimizer = adamw(_trained(self.critic), lr=self.critic_lr,
                                      weight_decay=self.critic_weight_decay)

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.critic.state_dict()) if self.critic is not None else {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if self.critic is not None and state:
            self.critic.load_state_dict(state)

    def json_state(self) -> dict[str, Any]:
        return {"batches": self.batches, "actor_steps": self.actor_steps, "critic_updates": self.critic_updates}

    def load_json_state(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.batches = int(state.get("batches", 0) or 0)
        self.actor_steps = int(state.get("actor_steps", 0) or 0)
        self.critic_updates = int(state.get("critic_updates", 0) or 0)

    def restore(self, snapshot: Any) -> None:
        """Back to the accepted critic; its optimizer's moments restart (as the policy's do)."""
        super().restore(snapshot)
        if self.critic is not None:
            self.critic_optimizer = adamw(_trained(self.critic), lr=self.critic_lr,
                                          weight_decay=self.critic_weight_decay)

    # -- advantages --------------------------------------------------------------------------------------------

    def actor_lambdas(self, batch: TokenBatch) -> Tensor:
        """Per-sample actor λ: length-adaptive on the whole response span, or the fixed ``lam``."""
        if not self.length_adaptive:
            return torch.full((batch.size,), self.lam, dtype=torch.float64)
        return torch.tensor([length_adaptive_lambda(int(n), self.lambda_alpha) for n in batch.response_lengths],
                            dtype=torch.float64)

    def advantages(self, values: Tensor, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        """Actor ``(advantages, returns)`` ``[B, L]`` from ``values`` by skip-observation GAE (actor λ)."""
        return skip_observation_gae(values.detach().cpu(), batch.action_mask.cpu(), batch.rewards.cpu(),
                                    gamma=self.gamma, lam=self.actor_lambdas(batch))

    def critic_targets(self, values: Tensor, batch: TokenBatch) -> Tensor:
        """The critic's regression targets ``[B, L]``: λ_critic-returns (0 on observation and padding)."""
        _, returns = skip_observation_gae(values.detach().cpu(), batch.action_mask.cpu(), batch.rewards.cpu(),
                                          gamma=self.gamma, lam=self.critic_lambda)
        return returns

    # -- the step ----------------------------------------------------------------------------------------------

    def prepare(self, policy, batch: TokenBatch) -> Prepared:
        if self.critic is None:
            raise RuntimeError("SAOObjective.setup() was not called")
        self.batches += 1
        width = batch.seq_len
        micro = batch.split(self.micro_batches)
        norm = max(batch.norm_tokens, 1)
        targets: list[Tensor] = [None] * len(micro)  # type: ignore[list-item]
        first: list[Tensor] = [None] * len(micro)  # type: ignore[list-item]
        last: list[Tensor] = [None] * len(micro)  # type: ignore[list-item]
        critic_losses = []
        for step in range(self.critic_steps_per_actor):
            self.critic_optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for i, mb in enumerate(micro):
                values = self.critic(mb.input_ids, mb.attention_mask)
                if step == 0:
                    first[i] = values.detach()
                    # Targets come from the values before this step's updates (fixed across the critic steps).
                    targets[i] = self.critic_targets(first[i], mb).to(values.device, values.dtype)
                last[i] = values.detach()  # the last pass's values feed the actor (reef's slime bridge)
                loss = token_sum((values - targets[i]) ** 2, mb.action_mask) / norm
                loss.backward()
                total += float(loss.detach())
            if self.critic_max_grad_norm is not None:
                clipped_step(self.critic_optimizer, _trained(self.critic), float(self.critic_max_grad_norm),
                             step_nonfinite=True)
            else:
                self.critic_optimizer.step()
            self.critic_optimizer.zero_grad(set_to_none=True)
            critic_losses.append(total)
        self.critic_updates += self.critic_steps_per_actor
        v_first = torch.cat([_pad_to(v, width) for v in first])
        v_last = torch.cat([_pad_to(v, width) for v in last])
        returns = torch.cat([_pad_to(t, width) for t in targets])
        adv, _ = self.advantages(v_last, batch)
        adv = adv.to(device=batch.device, dtype=torch.float32)
        train_actor = self.batches > self.num_critic_only_steps
        if train_actor:
            self.actor_steps += 1
        mask = batch.action_mask > 0
        lambdas = self.actor_lambdas(batch)
        metrics = {
            "critic/loss": critic_losses[0],
            "critic/loss_last": critic_losses[-1],
            "critic/explained_variance": explained_variance(v_first, returns, mask),
            "critic/value_mean": float(v_first[mask].mean()) if mask.any() else 0.0,
            "sao/critic_updates": float(self.critic_steps_per_actor),
            "sao/actor_trained": float(train_actor),
            "sao/lambda_mean": float(lambdas.mean()),
            "sao/effective_token_rate": batch.stats.get("action_tokens", 0.0)
            / max(batch.stats.get("response_tokens", 0.0), 1.0),
        }
        return Prepared(batch=batch.with_extras(advantages=adv), metrics=metrics, update_policy=train_actor)


class GRPODISObjective(DISObjective):
    """The control arm ``sao-grpo-dis``: group-relative advantages with the same DIS loss (no critic).

    ``A_i = r_i − mean(r_group)`` (divided by the group's std + 1e-6 with ``normalize_std``), broadcast to every
    action token of sample ``i``. Groups: the samples' ``group_key`` when every sample has one, else consecutive
    runs of ``group_size`` (the batch must then be a multiple of it).
    """

    name = "sao-grpo-dis"
    slime_loss = "grpo_dis_loss"

    def __init__(self, *, eps_clip: float, eps_clip_high: float | None, group_size: int = SAOOptions.group_size,
                 normalize_std: bool = SAOOptions.normalize_std):
        super().__init__(eps_clip=eps_clip, eps_clip_high=eps_clip_high)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise ConfigError(f"sao-grpo-dis: group_size must be an integer >= 2, got {group_size!r}")
        self.group_size = group_size
        self.normalize_std = bool(normalize_std)
        self.steps = 0

    def groups(self, batch: TokenBatch) -> list[list[int]]:
        """Row indices of each comparison group."""
        keys = batch.group_keys
        if keys and all(k is not None for k in keys):
            order: dict[str, list[int]] = {}
            for i, key in enumerate(keys):
                order.setdefault(key, []).append(i)
            # Two complete groups of one key (the same prompt asked twice) stay two groups, as the processor made.
            return [rows[i:i + self.group_size] for rows in order.values()
                    for i in range(0, len(rows), self.group_size)]
        if batch.size % self.group_size:
            raise ValidationFailed(f"sao-grpo-dis: a batch of {batch.size} samples without group keys does not "
                                   f"split into groups of {self.group_size}")
        return [list(range(i, i + self.group_size)) for i in range(0, batch.size, self.group_size)]

    def sample_advantages(self, batch: TokenBatch) -> tuple[Tensor, int]:
        """Per-sample advantages ``[B]`` and the number of uniform groups (all rewards equal: no signal)."""
        rewards = batch.rewards.detach().cpu().double()
        adv = torch.zeros_like(rewards)
        uniform = 0
        for rows in self.groups(batch):
            r = rewards[rows]
            adv[rows] = grpo_advantages(r, len(rows), normalize_std=self.normalize_std)
            uniform += int(bool((r == r[0]).all()))
        return adv.float(), uniform

    def prepare(self, policy, batch: TokenBatch) -> Prepared:
        adv, uniform = self.sample_advantages(batch)
        groups = len(self.groups(batch))
        per_token = adv.to(batch.device).unsqueeze(1) * batch.action_mask
        self.steps += 1
        metrics = {"grpo/groups": float(groups), "grpo/uniform_group_fraction": uniform / max(groups, 1)}
        return Prepared(batch=batch.with_extras(advantages=per_token), metrics=metrics)

    def json_state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_json_state(self, state: dict[str, Any] | None) -> None:
        self.steps = int((state or {}).get("steps", 0) or 0)


def objective_for(opts: SAOOptions, critic_lr: float,
                  critic_lora: tuple[int, float, int | None] | None = None) -> Objective:
    """The objective validated options describe: SAO, or the GRPO-with-DIS control arm.

    ``critic_lora`` (rank, alpha, layers: the trainer section's) is the adapter a critic gets when
    ``opts.critic_lora`` is set."""
    if opts.advantage == "grpo":
        return GRPODISObjective(eps_clip=opts.eps_clip, eps_clip_high=opts.eps_clip_high,
                                group_size=opts.group_size, normalize_std=opts.normalize_std)
    return SAOObjective(
        eps_clip=opts.eps_clip, eps_clip_high=opts.eps_clip_high,
        critic_steps_per_actor=opts.critic_steps_per_actor, num_critic_only_steps=opts.num_critic_only_steps,
        length_adaptive_lambda=opts.length_adaptive_lambda, lambda_alpha=opts.lambda_alpha, lam=opts.lam,
        critic_lambda=opts.critic_lambda, gamma=opts.gamma, critic_lr=critic_lr,
        critic_max_grad_norm=opts.critic_max_grad_norm,
        critic_lora=critic_lora if opts.critic_lora else None,
    )
