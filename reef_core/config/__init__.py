"""Configuration: typed sections (schema) composed from Hydra overrides (compose).

The composing functions load on first use (PEP 562): a process that only reads a composed config, as ``reef serve``
does with one composed in a child process (:mod:`.apart`), never imports Hydra or OmegaConf.
"""

from __future__ import annotations

from .schema import ReefConfig, register_schema

_COMPOSE = frozenset({"as_yaml", "available_recipes", "compose_config", "recipe_descriptions", "redacted", "to_plain"})

__all__ = ["ReefConfig", "as_yaml", "available_recipes", "compose_config", "recipe_descriptions", "redacted",
           "register_schema", "to_plain"]


def __getattr__(name: str):
    if name in _COMPOSE:
        from . import compose

        return getattr(compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
