"""The objective contract: what a weight recipe supplies to a trainer backend.

An :class:`Objective` is a loss over a :class:`~reef_core.grow.token_batch.TokenBatch` (token ids, action mask,
rollout log-probs, rewards). The backend (:class:`~reef_core.grow.torch_backend.TorchTrainer`) owns the policy, the
optimizer, micro-batching and export; the objective owns everything algorithm-specific. One optimizer step of the
policy runs as::

    objective.setup(policy, tokenizer, device, micro_batches=n)     # once, before any adapter is attached
                                                                     # (+ reference=... if needs_reference)
    prepared = objective.prepare(policy, batch)                      # no policy gradient: critic steps, advantages
    if prepared.update_policy:
        for micro in prepared.batch.split(n):
            loss, sums = objective.loss(policy, micro, prepared)     # loss of the micro-batch, already scaled
            loss.backward()                                          # so that the micro-batch losses add up
        optimizer.step()
    metrics = objective.summarize(prepared, summed sums)

Scaling rule: a micro-batch keeps the normalisers of the whole batch (``batch.norm_tokens``,
``batch.norm_samples``), so an objective that divides by them returns losses whose sum over micro-batches is the
full-batch loss; gradient accumulation is then exact. ``sums`` returned by :meth:`Objective.loss` must be additive
(counts and sums); :meth:`Objective.summarize` turns them into means.

Algorithm state: tensors (a critic) through :meth:`~Objective.state_dict`/:meth:`~Objective.load_state_dict`, a
small JSON summary (step counters) through :meth:`~Objective.json_state`/:meth:`~Objective.load_json_state`, and
:meth:`~Objective.snapshot`/:meth:`~Objective.restore` so a rejected candidate rolls the auxiliary models back with
the policy.

Reference model: an objective that compares the policy with the weights the scenario started from (a KL term to
the base, a teacher scoring the student's tokens after a hinted prompt) sets ``needs_reference = True``; ``setup``
then also receives ``reference=``, a :class:`~reef_core.grow.reference.ReferenceModel` (kept as ``self.reference``
by the default ``setup``) whose ``logprobs(batch)`` and ``logprobs(batch, prompts=...)`` score the batch's action
tokens under the frozen base, aligned like :func:`sequence_logprobs`. With LoRA it is the adapter-disabled policy (no
second copy of the weights); with full weights one frozen copy per process and base, loaded on first use. An
objective that does not ask is called without the keyword (its ``setup`` need not accept it) and loads nothing.

Helpers shared by objectives: :func:`sequence_logprobs` (the policy's log-probability of every token),
:func:`action_logits` (its next-token logits over the action span, e.g. to score a top-K set) and
:class:`ValueModel` (a critic: a copy of the policy's body with a zero-initialised scalar head).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from reef_core.errors import ConfigError
from reef_core.grow.logprobs import action_logits, sequence_logprobs  # noqa: F401 - part of this module's API
from reef_core.grow.token_batch import TokenBatch

if TYPE_CHECKING:
    from reef_core.grow.reference import ReferenceModel


@dataclass
class Prepared:
    """What :meth:`Objective.prepare` hands to the loss."""

    #: The batch the loss runs on, usually the input with per-row tensors attached (``batch.extras``).
    batch: TokenBatch
    #: Metrics of the preparation (critic loss, explained variance...), merged into the step's metrics.
    metrics: dict[str, float] = field(default_factory=dict)
    #: False: this step trains auxiliary models only (e.g. critic warm-up); the policy is not updated.
    update_policy: bool = True
    #: Anything else the loss needs (global, not per row).
    data: dict[str, Any] = field(default_factory=dict)


class Objective(ABC):
    """A recipe's loss over token-level samples (see the module docstring)."""

    #: Name recorded in metrics and release provenance.
    name: str = "objective"
    #: True: :meth:`setup` receives ``reference=`` (the frozen base, see the module docstring).
    needs_reference: bool = False
    #: The frozen base given to :meth:`setup` (None unless ``needs_reference``).
    reference: "ReferenceModel | None" = None
    #: The loss ``trainer.backend=slime`` trains this objective with: the name of a ``reef_slime_hooks`` function
    #: (``--loss-type custom_loss``, e.g. ``"sao_loss"``) or one of slime's built-in loss types (``"policy_loss"``,
    #: ``"sft_loss"``). None: the slime backend refuses the objective.
    slime_loss: str | None = None

    def setup(self, policy: nn.Module, tokenizer: Any, device: torch.device, *, micro_batches: int = 1,
              reference: "ReferenceModel | None" = None) -> None:
        """Build auxiliary models (a critic...) from the base ``policy``, before any adapter is attached.

        ``micro_batches`` is the backend's gradient-accumulation count, for auxiliary updates that need it.
        ``reference`` (only passed when :attr:`needs_reference` is set) is the frozen base model; an override
        that asks for it accepts the keyword and passes it on to this method."""
        self.device = torch.device(device)
        self.micro_batches = max(1, int(micro_batches))
        self.reference = reference

    def prepare(self, policy: nn.Module, batch: TokenBatch) -> Prepared:
        """Work before the policy step that needs no policy gradient (advantages, critic updates)."""
        return Prepared(batch=batch)

    @abstractmethod
    def loss(self, policy: nn.Module, batch: TokenBatch, prepared: Prepared) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch (scaled by the whole batch's normalisers) and additive metric sums."""

    def summarize(self, prepared: Prepared, sums: dict[str, float]) -> dict[str, float]:
        """Final metrics of a step from the summed micro-batch ``sums`` (default: the sums as they are)."""
        return dict(sums)

    # -- trainer.backend=slime (an objective whose ``slime_loss`` is a reef_slime_hooks function) ----------------

    def check_slime(self) -> None:
        """Refuse, when a slime trainer is built, a setting this objective's slime hook cannot train (default:
        none); raise :class:`~reef_core.errors.ConfigError`."""

    def slime_advantages(self, prepared: Prepared) -> Tensor:
        """``[B, L]`` per-token advantages the slime hook trains on (default: what :meth:`prepare` attached as
        ``batch.extras["advantages"]``)."""
        adv = prepared.batch.extras.get("advantages")
        if adv is None:
            raise ValueError(f"objective {self.name!r}: prepare() attached no per-token advantages")
        return adv.detach().float().cpu()

    def slime_header(self, batch: TokenBatch) -> dict[str, Any]:
        """The constants the slime hook reads from the job's header, and ``loss_norm``: the normaliser ``D`` this
        objective divides its loss by (see ``reef_slime_hooks``). Default: the clip band (``eps_clip``,
        ``eps_clip_high``) of an objective with ``eps_low``/``eps_high``, and ``D`` the batch's action tokens."""
        header: dict[str, Any] = {"loss_norm": float(max(batch.norm_tokens, 1))}
        if hasattr(self, "eps_low"):
            header.update(eps_clip=float(self.eps_low), eps_clip_high=float(self.eps_high))
        return header

    # -- algorithm state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Tensor]:
        """Tensor state worth exporting (e.g. critic weights); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def json_state(self) -> dict[str, Any]:
        """Small JSON-serialisable state committed with every step (counters, schedules)."""
        return {}

    def load_json_state(self, state: dict[str, Any] | None) -> None:
        """Restore what :meth:`json_state` returned (after a restart); ``None`` means a fresh start."""

    def snapshot(self) -> Any:
        """A copy of the in-memory state, taken when a candidate is accepted (default: tensors + JSON)."""
        return ({k: v.detach().clone() for k, v in self.state_dict().items()}, copy.deepcopy(self.json_state()))

    def restore(self, snapshot: Any) -> None:
        """Return to a :meth:`snapshot` (the candidate trained since then was rejected)."""
        tensors, state = snapshot
        if tensors:
            self.load_state_dict(tensors)
        self.load_json_state(state)


# --------------------------------------------------------------------------------------------------- helpers


def token_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x`` where ``mask`` is set (NaN/inf outside the mask are ignored)."""
    return torch.where(mask.to(torch.bool), x, torch.zeros_like(x)).sum()


def text_config(model: nn.Module):
    """The (text) config of a model, unwrapping PEFT and multimodal configs."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def lora_targets(model: nn.Module, targets: str | list[str], layers: int | None) -> dict[str, Any]:
    """``LoraConfig`` arguments adapting ``targets`` in the last ``layers`` transformer layers of ``model``
    (``None``: every layer). peft takes a layer subset only with named modules, so ``"all-linear"`` becomes the
    names of the model's linear layers (the output head excluded)."""
    if layers is None:
        return {"target_modules": targets}
    total = int(text_config(model).num_hidden_layers)
    if layers > total:
        raise ConfigError(f"trainer lora_layers is {layers} but the model has {total} layers")
    if targets == "all-linear":
        targets = linear_names(model)
    return {"target_modules": list(targets), "layers_to_transform": list(range(total - layers, total))}


def linear_names(model: nn.Module) -> list[str]:
    """Names (last component) of the linear layers inside ``model``'s transformer, its output head excluded."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and module is not head and "." in name})


class ValueModel(nn.Module):
    """A critic: a copy of the policy's transformer body plus a zero-initialised scalar head.

    ``forward(input_ids, attention_mask)`` returns ``[B, L]`` float32 values aligned like
    :func:`sequence_logprobs`: ``values[:, t]`` is the value of the state *before* token ``t`` (read from the hidden
    state at ``t - 1``); position 0 is 0. A zero head makes every initial value 0.
    """

    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module, *, lora_rank: int = 0, lora_alpha: float = 16.0,
                    lora_layers: int | None = None, seed: int = 0) -> "ValueModel":
        """Deep-copy the body of a causal LM (``model.model`` for Llama/Qwen-style models) into a critic.

        Every weight of the copy trains, or with ``lora_rank`` > 0 a LoRA adapter (rank, ``lora_alpha``, every
        linear layer of the body, or of its last ``lora_layers`` layers, initialised from ``seed``) over the frozen
        copy: the backward pass then skips
        the weight gradients of the body and the optimizer holds a few hundred thousand parameters, not the whole
        model. The head trains in full either way."""
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        prefix = getattr(base, "base_model_prefix", "model")
        body = getattr(base, prefix, None)
        if not isinstance(body, nn.Module):
            raise TypeError(f"{type(base).__name__} has no transformer body at .{prefix}")
        critic = cls(copy.deepcopy(body), int(text_config(base).hidden_size))
        param = next(body.parameters())
        critic.head.to(device=param.device)  # the head stays float32 for a stable regression
        if lora_rank > 0:
            from peft import LoraConfig, inject_adapter_in_model

            critic.body.requires_grad_(False)
            config = LoraConfig(r=int(lora_rank), lora_alpha=float(lora_alpha), lora_dropout=0.0, bias="none",
                                **lora_targets(base, linear_names(base), lora_layers))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                # Into the critic, not its body: peft finds a layer's index only under a parent (``body.layers.N``).
                inject_adapter_in_model(config, critic)
            for name, weight in critic.named_parameters():
                weight.requires_grad_("lora_" in name or name.startswith("head."))
        else:
            critic.body.requires_grad_(True)
        return critic

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        v = self.head(hidden.float()).squeeze(-1)
        out = torch.zeros_like(v)
        out[:, 1:] = v[:, :-1]
        return out
