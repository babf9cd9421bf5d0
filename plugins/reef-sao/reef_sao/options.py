"""SAO's knobs (``recipe.options``): :class:`SAOOptions`, the one place their defaults live.

Parsed from the recipe section's plain ``options`` dict (snake_case or kebab-case keys); unknown keys are a
:class:`ConfigError`. The objectives in :mod:`reef_sao.objectives` default to these values, and the recipe files
under ``reef_sao/conf`` only state what a deployment changes. Imports no torch, so config checks stay light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reef_core.api import ConfigError, option_values

ADVANTAGES = ("gae", "grpo")

#: Options that belong to the processor (per_report or grouped): accepted and checked, not used by the trainer.
PROCESSOR_OPTIONS = frozenset({"max_staleness", "require_score", "max_held_inferences", "key", "groups_per_batch",
                               "partial_policy", "timeout_s", "min_partial_size", "slot"})


@dataclass(frozen=True)
class SAOOptions:
    """SAO's knobs with the paper's defaults (arXiv:2607.07508; reef's ``recipes/sao``)."""

    #: ``gae``: SAO (critic + skip-observation GAE); ``grpo``: the control arm sao-grpo-dis.
    advantage: str = "gae"
    #: Accepted rollouts per optimizer step (paper 128); must equal the trainer's global batch.
    batch_size: int = 128
    eps_clip: float = 0.3
    #: No default on purpose: an implicit ε_h silently changes the method (see ``DISObjective``).
    eps_clip_high: float | None = None
    critic_steps_per_actor: int = 2
    num_critic_only_steps: int = 0
    length_adaptive_lambda: bool = True
    lambda_alpha: float = 1.5
    #: Actor λ when ``length_adaptive_lambda`` is off.
    lam: float = 1.0
    critic_lambda: float = 1.0
    gamma: float = 1.0
    #: ``None``: the trainer section's ``critic_lr``.
    critic_lr: float | None = None
    #: Train the critic as a LoRA adapter (the trainer section's ``lora_rank``, ``lora_alpha``, ``lora_layers``) over
    #: its frozen copy of the policy's body, plus its full head. Off (the paper): every weight of the critic trains.
    critic_lora: bool = False
    critic_max_grad_norm: float | None = 1.0
    max_grad_norm: float | None = 1.0
    weight_decay: float = 0.0
    #: Add the critic's weights to every release (``algorithm/sao.safetensors``) so a restart resumes it.
    save_critic: bool = False
    #: GRPO control: group size (paper 4) and std normalisation (off: ``r − mean``).
    group_size: int = 4
    normalize_std: bool = False

    @classmethod
    def from_options(cls, options: Any, processor_options: Any = None) -> "SAOOptions":
        """Parse ``recipe.options`` (a mapping); unknown keys are a :class:`ConfigError`.

        ``processor_options`` (``recipe.processor_options``) are only checked for consistency with the trainer:
        the processor's batch equals ``batch_size``."""
        data = _plain(options)
        values = option_values(cls, data, who="sao", aliases={"lambda": "lam"}, ignore=PROCESSOR_OPTIONS)
        opts = cls(**values)
        opts.validate({**data, **_plain(processor_options)})
        return opts

    def validate(self, raw: Mapping[str, Any] | None = None) -> None:
        """Check the knobs that need no model; ``raw`` holds processor options to cross-check."""
        if not isinstance(self.critic_lora, bool):
            raise ConfigError(f"sao: critic_lora must be true or false, got {self.critic_lora!r}")
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"sao: advantage must be one of {', '.join(ADVANTAGES)}, got {self.advantage!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"sao: batch_size must be a positive integer, got {self.batch_size!r}")
        raw = {str(k).replace("-", "_"): v for k, v in (raw or {}).items()}
        processor_batch = raw.get("batch_size")
        if processor_batch is not None and processor_batch != self.batch_size:
            raise ConfigError(f"sao: the processor's batch_size ({processor_batch}) must equal the trainer's "
                              f"batch_size ({self.batch_size}): one optimizer step per batch")
        if self.advantage == "grpo":
            if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
                raise ConfigError(f"sao-grpo-dis: group_size must be an integer >= 2, got {self.group_size!r}")
            if self.batch_size % self.group_size:
                raise ConfigError(f"sao-grpo-dis: batch_size {self.batch_size} must be a multiple of group_size "
                                  f"{self.group_size}")
            if raw.get("group_size") is not None and raw["group_size"] != self.group_size:
                raise ConfigError(f"sao-grpo-dis: the processor's group_size ({raw['group_size']}) must equal "
                                  f"the trainer's ({self.group_size})")
            groups = raw.get("groups_per_batch")
            if groups is not None and int(groups) * self.group_size != self.batch_size:
                raise ConfigError(f"sao-grpo-dis: groups_per_batch ({groups}) x group_size ({self.group_size}) must "
                                  f"equal batch_size ({self.batch_size})")


def _plain(section: Any) -> Mapping:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"sao: expected a mapping, got {type(section).__name__}")
    return section
