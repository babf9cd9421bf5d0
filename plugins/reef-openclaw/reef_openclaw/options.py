"""OpenClaw-RL's trainer knobs (``recipe.options``): :class:`OpenClawOptions`, the one place their defaults live.

Parsed from the recipe section's plain ``options`` dict (snake_case or kebab-case keys); unknown keys are a
:class:`ConfigError`. The judge's and the session's knobs belong to the processor (``recipe.processor_options``, see
:mod:`reef_openclaw.processor`). Imports no torch, so config checks stay light.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reef_core.api import ConfigError, option_values

HINT_SELECTIONS = ("sequence_optimal", "token_optimal", "shortest")


@dataclass(frozen=True)
class OpenClawOptions:
    """OpenClaw-RL's knobs with the paper's defaults (arXiv:2603.10165; reef's ``recipes/openclawrl``)."""

    #: Judged turns per optimizer step (paper 16); must equal the processor's batch_size.
    batch_size: int = 16
    #: Weights of the binary-RL and the on-policy-distillation terms; both 0 is the control arm (no learning).
    w_rl: float = 1.0
    w_opd: float = 1.0
    #: PPO clip band (1 - eps_clip, 1 + eps_clip_high), for both terms.
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    #: OPD advantages are clip(teacher - student, -c, c) before the top-K weight.
    adv_diff_clip: float = 1.0
    #: Which hint candidate teaches: sequence_optimal, token_optimal or shortest.
    hint_selection: str = "sequence_optimal"
    #: AdamW settings (paper: weight decay 0.1, beta2 0.98; the learning rate is trainer.lr).
    weight_decay: float = 0.1
    adam_beta2: float = 0.98
    max_grad_norm: float | None = 1.0

    @classmethod
    def from_options(cls, options: Any, processor_options: Any = None) -> "OpenClawOptions":
        """Parse ``recipe.options``; ``processor_options`` is only checked for a consistent batch size."""
        opts = cls(**option_values(cls, options, who="openclaw"))
        opts.validate(_plain(processor_options, "recipe.processor_options"))
        return opts

    def validate(self, processor_options: Mapping) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"openclaw: recipe.options.batch_size must be a positive integer, "
                              f"got {self.batch_size!r}")
        for name in ("w_rl", "w_opd", "eps_clip", "eps_clip_high", "adv_diff_clip", "weight_decay", "adam_beta2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"openclaw: recipe.options.{name} must be a finite non-negative number, "
                                  f"got {value!r}")
        if not self.adam_beta2 < 1:
            raise ConfigError(f"openclaw: recipe.options.adam_beta2 must be below 1, got {self.adam_beta2}")
        if self.hint_selection not in HINT_SELECTIONS:
            raise ConfigError(f"openclaw: recipe.options.hint_selection must be one of {', '.join(HINT_SELECTIONS)}, "
                              f"got {self.hint_selection!r}")
        raw = {str(k).replace("-", "_"): v for k, v in processor_options.items()}
        if raw.get("batch_size") is not None and raw["batch_size"] != self.batch_size:
            raise ConfigError(f"openclaw: recipe.processor_options.batch_size ({raw['batch_size']}) must equal "
                              f"recipe.options.batch_size ({self.batch_size}): one optimizer step per batch")


def _plain(section: Any, where: str) -> Mapping:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"openclaw: {where} must be a mapping, got {type(section).__name__}")
    return section
