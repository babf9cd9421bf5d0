"""Configuration: typed sections (schema) composed from Hydra overrides (compose)."""

from .compose import available_recipes, compose_config, recipe_descriptions, redacted
from .schema import ReefConfig, register_schema

__all__ = ["ReefConfig", "available_recipes", "compose_config", "recipe_descriptions", "redacted", "register_schema"]
