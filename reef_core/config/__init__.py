"""Configuration: typed sections (schema) composed from Hydra overrides (compose)."""

from .compose import as_yaml, available_recipes, compose_config, recipe_descriptions, redacted, to_plain
from .schema import ReefConfig, register_schema

__all__ = ["ReefConfig", "as_yaml", "available_recipes", "compose_config", "recipe_descriptions", "redacted",
           "register_schema", "to_plain"]
