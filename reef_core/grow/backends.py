"""Trainer backends other than ``torch``, chosen by ``trainer.backend``.

Weight recipes build their trainer with ``TorchTrainer.from_config``; for another backend that call lands here
and builds the backend's trainer around the same objective. Each entry is ``"module:Class"`` with a
``from_config(objective, context, trainer, who=..., **overrides)`` classmethod, imported only when chosen.
"""

from __future__ import annotations

from typing import Any

from ..plugins import load_callable
from ..errors import ConfigError

BACKENDS: dict[str, str] = {
    "slime": "reef_core.grow.slime.trainer:SlimeTrainer",
}


def build_trainer(objective: Any, context: Any, trainer: Any, *, who: str, **overrides) -> Any:
    """The trainer of ``trainer.backend`` (not ``torch``) running ``objective``."""
    target = BACKENDS.get(trainer.backend)
    if target is None:
        raise ConfigError(f"{who}: unknown trainer.backend {trainer.backend!r} "
                          f"(known: {', '.join(['torch', 'ray', *sorted(BACKENDS)])})")
    return load_callable(target, "trainer backend").from_config(objective, context, trainer, who=who, **overrides)
