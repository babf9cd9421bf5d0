"""TTT-Discover's knobs (``recipe.options``): :class:`TTTOptions`, the one place their defaults live.

Parsed from the recipe section's plain ``options`` dict (snake_case or kebab-case keys); unknown keys are a
:class:`ConfigError` naming them. Defaults are the paper's and reef's (recipes reference §5.3): 8 groups x 64
rollouts, entropic adaptive-β advantages, KL 0.1 to the frozen base, PUCT c = 1, 2 children per parent, an
archive of 1000 states. Imports no torch, so config checks stay light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reef_core.api import ConfigError, option_values

from reef_ttt.advantages import ESTIMATORS

MODES = ("discover", "guidance")


@dataclass(frozen=True)
class TTTOptions:
    """TTT-Discover and Guidance-TTT knobs (see the module docstring)."""

    #: ``discover``: the served model writes the next state. ``guidance``: it writes one ``<guidance>`` block and
    #: an executor turns parent + guidance into the next state.
    mode: str = "discover"
    #: The problem: a ``module:factory`` path called with ``task_options`` (see :mod:`reef_ttt.task`).
    task: str = "reef_ttt.tasks.circle_packing:make_task"
    task_options: dict = field(default_factory=dict)
    #: Guidance mode: the executor clients run, a ``module:function`` path or an OpenAI-compatible base URL; unset:
    #: the task's own ``execute``.
    executor: str | None = None
    #: Guidance mode: a guide reply must hold exactly one non-empty ``<guidance>...</guidance>``; off (the tiny CPU
    #: profile, whose random guide cannot learn tags in minutes): any non-empty reply is the guidance.
    guidance_tags: bool = True
    #: G and R: one step is the complete grid of G groups x R rollouts (one optimizer step).
    groups_per_step: int = 8
    rollouts_per_group: int = 64
    advantage: str = "entropic_adaptive_beta"
    #: Weight of the centred KL penalty to the frozen base, folded into the advantage (reef 0.1; upstream 0.0).
    kl_coef: float = 0.1
    puct_c: float = 1.0
    children_per_parent: int = 2
    archive_cap: int = 1000
    #: AdamW betas and weight decay of the policy (paper: (0.9, 0.95), 0); no gradient clipping by default.
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    #: False is the control arm (``+ttt_arm=control``): the same search, archive and releases, but every
    #: advantage is zeroed, so no step changes the weights (best-of-N search with the frozen model).
    learn: bool = True

    @classmethod
    def from_options(cls, options: Any) -> "TTTOptions":
        values = option_values(cls, options, who="ttt")
        if "task_options" in values:
            values["task_options"] = dict(_plain(values["task_options"], "recipe.options.task_options"))
        if "betas" in values and isinstance(values["betas"], (list, tuple)):
            values["betas"] = tuple(values["betas"])
        opts = cls(**values)
        opts.validate()
        return opts

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"ttt: recipe.options.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.task, str) or ":" not in self.task:
            raise ConfigError(f"ttt: recipe.options.task must be a 'module:factory' path, got {self.task!r}")
        _int("groups_per_step", self.groups_per_step, 1)
        # R = 2 is degenerate under the adaptive β (the winner's baseline underflows: A ~ 1e12).
        _int("rollouts_per_group", self.rollouts_per_group, 3)
        _int("children_per_parent", self.children_per_parent, 1)
        _int("archive_cap", self.archive_cap, 1)
        if self.advantage not in ESTIMATORS:
            raise ConfigError(f"ttt: recipe.options.advantage must be one of {', '.join(ESTIMATORS)}, "
                              f"got {self.advantage!r}")
        for name in ("kl_coef", "puct_c", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"ttt: recipe.options.{name} must be a number >= 0, got {value!r}")
        if self.max_grad_norm is not None and (isinstance(self.max_grad_norm, bool) or not isinstance(
                self.max_grad_norm, (int, float)) or self.max_grad_norm <= 0):
            raise ConfigError(f"ttt: recipe.options.max_grad_norm must be positive or null, got {self.max_grad_norm!r}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"ttt: recipe.options.betas must be two numbers in [0, 1), got {self.betas!r}")
        for name in ("guidance_tags", "learn"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ttt: recipe.options.{name} must be true or false")
        if not self.learn and self.weight_decay:
            raise ConfigError("ttt: recipe.options.learn=false (the control arm) needs weight_decay 0: decay alone "
                              "would change the weights")
        if self.executor is not None and (not isinstance(self.executor, str) or not (
                ":" in self.executor)):
            raise ConfigError(f"ttt: recipe.options.executor must be a 'module:function' path or an http(s) URL, "
                              f"got {self.executor!r}")

    @property
    def batch_size(self) -> int:
        return self.groups_per_step * self.rollouts_per_group


def check_processor_options(opts: TTTOptions, processor: str | None, processor_options: Any) -> None:
    """The processor must be the sequential grid barrier of exactly G x R, keeping constant groups for the
    archive (the trainer leaves them out of the gradient)."""
    if processor != "grid":
        raise ConfigError(f"ttt: recipe.processor must be 'grid' (the whole-step barrier), got {processor!r}")
    raw = {str(k).replace("-", "_"): v for k, v in _plain(processor_options, "recipe.processor_options").items()}
    expected = {"groups": opts.groups_per_step, "rollouts_per_group": opts.rollouts_per_group,
                "drop_constant_groups": False, "sequential": True}
    for key, value in expected.items():
        if raw.get(key) != value:
            raise ConfigError(f"ttt: recipe.processor_options.{key} must be {value!r} (got {raw.get(key)!r}): "
                              "the barrier must match the trainer's grid")
    if raw.get("batch_size") not in (None, opts.batch_size):
        raise ConfigError(f"ttt: recipe.processor_options.batch_size must equal G x R = {opts.batch_size}")
    if raw.get("max_staleness") not in (None, 0):
        raise ConfigError("ttt: recipe.processor_options.max_staleness must be 0 (a grid is served by one version)")


def _int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"ttt: recipe.options.{name} must be an integer >= {least}, got {value!r}")


def _plain(section: Any, where: str = "recipe.options") -> Mapping:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"ttt: {where} must be a mapping, got {type(section).__name__}")
    return section
