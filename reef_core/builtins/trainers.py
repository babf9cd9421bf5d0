"""Built-in trainer ``torch``: the torch backend running an objective named in config.

Recipe packages usually register their own trainer (``sao`` builds its objective from validated options). The
built-in lets a deployment train with any :class:`~reef_core.grow.objective.Objective` without writing a plugin::

    recipe:
      trainer: torch
      options:
        objective: my_package.objectives:MyObjective   # "module:attribute" (or "module.attribute")
        objective_options: {eps_clip: 0.2}              # keyword arguments of the objective factory
        max_grad_norm: 1.0                              # optional (null: no clipping)

The ``trainer`` section gives the backend settings (``lr``, ``lora``, ``lora_rank``, ``lora_alpha``,
``grad_accumulation``, ``device``; ``backend`` is ``torch``, or ``ray`` for data-parallel training on Ray workers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import hookimpl
from ..config.schema import RecipeConfig, TrainerConfig
from ..errors import ConfigError
from ..extras import require

_OPTIONS = ("objective", "objective_options", "max_grad_norm", "weight_decay")


def _mapping(value: Any, what: str) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"trainer 'torch': {what} must be a mapping")
    return value


def make_torch_trainer(*, scenario: str, recipe: RecipeConfig, trainer: TrainerConfig, context: Any, **_extra):
    """Build a :class:`~reef_core.grow.torch_backend.TorchTrainer` around ``recipe.options.objective``."""
    require("train", "the torch trainer")
    from ..plugins import load_callable
    from ..grow.objective import Objective
    from ..grow.torch_backend import TorchTrainer

    options = {str(k).replace("-", "_"): v for k, v in _mapping(recipe.options, "recipe.options").items()}
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigError(f"trainer 'torch' has no option(s) {', '.join(unknown)} (known: {', '.join(_OPTIONS)})")
    target = options.get("objective")
    if not target:
        raise ConfigError("trainer 'torch' needs recipe.options.objective ('module:Objective')")
    factory = load_callable(str(target), "objective")
    kwargs = dict(_mapping(options.get("objective_options"), "recipe.options.objective_options"))
    try:
        objective = factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"objective {target!r} does not accept {sorted(kwargs)}: {exc}") from exc
    if not isinstance(objective, Objective):
        raise ConfigError(f"{target!r} did not build a reef_core.grow.objective.Objective")
    # Unset optimizer knobs keep TorchTrainer's own defaults (their one source).
    optimizer = {key: options[key] for key in ("max_grad_norm", "weight_decay") if key in options}
    return TorchTrainer.from_config(objective, context, trainer, who="trainer 'torch'", name="torch", **optimizer)


@hookimpl
def reef_register_trainers(register):
    register("torch", make_torch_trainer,
             description="torch backend (full weights or LoRA) running the objective named in recipe.options")
