"""The SkillClaw recipe's knobs (``recipe.options``), with the defaults of the reference recipe.

:class:`SkillClawOptions` is the one place these defaults live; ``conf/recipe/skillclaw.yaml`` reads them with
``${reef.default:...}``. Keys may be snake_case or kebab-case; unknown keys are a :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reef_core.api import ConfigError, load_object, option_values

#: Judge weights of the reference recipe: completion, response quality, efficiency, tool usage.
DEFAULT_JUDGE_WEIGHTS = {"completion": 0.55, "quality": 0.30, "efficiency": 0.05, "tool_usage": 0.10}


@dataclass
class SkillClawOptions:
    #: Graded sessions per day (the processor's batch size): the day's last report starts the night.
    batch_size: int = 60
    #: The scenario's first pool: ``{slug: {description, category, body}}``, ``{path: SKILL.md text}``, or a
    #: dotted name of either.
    initial_skills: Any = None
    #: The evolver's model: null/'served', a dotted callable ``fn(messages) -> str``, or ``{url, model, ...}``.
    evolver_model: Any = None
    #: Models of the summary and judge stages (null: the evolver model).
    summary_model: Any = None
    judge_model: Any = None
    #: Summarise each session before deciding (one model call per session).
    summarize: bool = True
    #: Sampling temperatures per stage (sent to endpoint and served models; a callable ignores them).
    summary_temperature: float = 0.2
    judge_temperature: float = 0.1
    decide_temperature: float = 0.4
    merge_temperature: float = 0.3
    judge_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_JUDGE_WEIGHTS))
    #: Sessions shown per group (the newest are kept).
    max_sessions_per_group: int = 30
    #: Attempts per model call on transport errors (backoff doubles from ``retry_backoff_s``).
    retries: int = 6
    retry_backoff_s: float = 0.5
    #: Tool names whose calls read a skill (argument ``slug`` or ``name``).
    skill_tools: list[str] = field(default_factory=lambda: ["read_skill"])
    #: Caps of the evolver's prompts: characters of one message/tool text in a digest, and of a digest.
    max_text_chars: int = 1200
    max_digest_chars: int = 12000
    #: Output cap (tokens) sent with every stage's request.
    max_tokens: int = 8192

    @classmethod
    def from_config(cls, options: Mapping[str, Any] | None) -> "SkillClawOptions":
        """Parse ``recipe.options`` (a plain mapping); unknown keys are a :class:`ConfigError`."""
        opts = cls(**option_values(cls, options, who="skillclaw"))
        opts._check()
        return opts

    def _check(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"recipe.options.{name} must be a positive integer, not {value!r}")

        for name in ("batch_size", "max_sessions_per_group", "retries", "max_text_chars", "max_digest_chars",
                     "max_tokens"):
            positive_int(name)
        for name in ("summary_temperature", "judge_temperature", "decide_temperature", "merge_temperature",
                     "retry_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"recipe.options.{name} must be a non-negative number, not {value!r}")
        if not isinstance(self.summarize, bool):
            raise ConfigError("recipe.options.summarize must be true or false")
        weights = self.judge_weights
        if not isinstance(weights, Mapping) or set(weights) != set(DEFAULT_JUDGE_WEIGHTS) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in weights.values()):
            raise ConfigError(f"recipe.options.judge_weights must map {', '.join(DEFAULT_JUDGE_WEIGHTS)} "
                              "to non-negative numbers")
        self.judge_weights = {k: float(v) for k, v in weights.items()}
        if not isinstance(self.skill_tools, (list, tuple)) or not all(isinstance(t, str) and t
                                                                     for t in self.skill_tools):
            raise ConfigError("recipe.options.skill_tools must be a list of tool names")
        self.skill_tools = list(self.skill_tools)

    def initial_pool(self) -> Any:
        """``initial_skills`` with a dotted name resolved (still unvalidated)."""
        value = self.initial_skills
        if isinstance(value, str):
            try:
                value = load_object(value)
            except Exception as exc:  # noqa: BLE001 - name the key
                raise ConfigError(f"recipe.options.initial_skills: cannot load {self.initial_skills!r}: {exc}") \
                    from None
            if callable(value):
                value = value()
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError("recipe.options.initial_skills must be a mapping (slug -> skill, or path -> text)")
        return value
