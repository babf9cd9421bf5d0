"""The ``skillclaw`` trainer: one night per day's batch of graded sessions, on the scenario's skill pool.

``train(batch)`` reads the serving pool (``skills/<slug>/SKILL.md``), runs :meth:`Evolver.night` on the batch's
sessions and returns the new pool as one candidate (harness artifact: the skill surface serves it), or None when
the night changed nothing. With ``evaluation.policy: always`` (the recipe's default) there is no gate: the next
day is the measurement, so a claim needs the frozen control run (see the README).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from reef_core.api import (
    Batch,
    CandidateUpdate,
    ChatModel,
    ConfigError,
    Skill,
    TrainContext,
    Trainer,
    TrainerSetup,
    ValidationFailed,
    encode_tree,
    pool_files,
    resolve_chat_model,
    validate_pool,
)

from .evolver import Evolver
from .options import SkillClawOptions

log = logging.getLogger("reef_skillclaw")


def _stage_spec(spec: Any, temperature: float, max_tokens: int) -> Any:
    """A chat-model config with the stage's sampling settings (an endpoint or the served model; a Python
    callable receives only the messages)."""
    if spec is None or spec == "served":
        spec = {"kind": "served"}
    if isinstance(spec, Mapping) and not spec.get("callable"):
        request = {"max_tokens": max_tokens, **dict(spec.get("request") or {}), "temperature": temperature}
        return {**spec, "request": request}
    return spec


def initial_pool(options: SkillClawOptions) -> dict[str, Skill]:
    """The scenario's first pool from ``initial_skills`` (slug -> {description, category, body|content}, or
    path -> SKILL.md text), validated."""
    raw = options.initial_pool()
    if all(isinstance(v, Mapping) for v in raw.values()):
        skills = []
        for slug, spec in raw.items():
            body = spec.get("body", spec.get("content"))
            skills.append(Skill(slug=str(slug), description=str(spec.get("description", "")),
                                category=str(spec.get("category", "")), body=str(body or "")))
        files = pool_files(skills)
    else:
        files = dict(raw)
    try:
        return validate_pool(files)
    except ValidationFailed as exc:
        raise ConfigError(f"recipe.options.initial_skills: {exc.message}") from None


class SkillClawTrainer(Trainer):
    """SkillClaw over a skill pool (see the module docstring)."""

    artifact_kind = "harness"

    def __init__(self, scenario: str, options: SkillClawOptions, setup: TrainerSetup | None = None, *,
                 decide: ChatModel | None = None, summary: ChatModel | None = None,
                 judge: ChatModel | None = None, sleep=None):
        self.scenario = scenario
        self.options = options
        self.seed_pool = initial_pool(options)
        engine = getattr(setup, "engine", None)
        run_async = getattr(setup, "run_async", None)

        def model(spec: Any, temperature: float, what: str) -> ChatModel:
            return resolve_chat_model(_stage_spec(spec, temperature, options.max_tokens), engine=engine,
                                      run_async=run_async, what=what)

        evolver_spec = options.evolver_model
        decide = decide or model(evolver_spec, options.decide_temperature, "skillclaw evolver_model")
        summary = summary or model(options.summary_model if options.summary_model is not None else evolver_spec,
                                   options.summary_temperature, "skillclaw summary_model")
        judge = judge or model(options.judge_model if options.judge_model is not None else evolver_spec,
                               options.judge_temperature, "skillclaw judge_model")
        kwargs = {"sleep": sleep} if sleep is not None else {}
        self.evolver = Evolver(options, decide=decide, summary=summary, judge=judge, **kwargs)
        self._lock = threading.Lock()
        self.nights: list[dict] = []

    def initial_files(self) -> Mapping[str, bytes]:
        return encode_tree(pool_files(self.seed_pool)) if self.seed_pool else {}

    def train(self, batch: Batch, ctx: TrainContext) -> CandidateUpdate | None:
        with self._lock:
            raw = ctx.current_files() if ctx.current_files is not None else {}
            pool = validate_pool(raw) if raw else dict(self.seed_pool)
            result = self.evolver.night(list(batch.samples), pool)
            night = {"step": ctx.step, "changes": result.changes, **result.metrics}
            self.nights.append(night)
            log.info("skillclaw %s night %d: %d sessions, %d changes (%s)", self.scenario, ctx.step,
                     len(batch.samples), len(result.changes),
                     ", ".join(f"{c['action']} {c['slug']}" for c in result.changes) or "none")
            if not result.changed:
                return None
            files = pool_files(result.pool)
            return CandidateUpdate(files=encode_tree(files), payload=files, metrics=dict(result.metrics),
                                   source={"kind": "skillclaw-night", "changes": result.changes})

    def status(self) -> dict:
        with self._lock:
            return {"nights": len(self.nights), "last_night": self.nights[-1] if self.nights else None}


def make_trainer(*, scenario: str, recipe: Any = None, trainer: Any = None, context: TrainerSetup, **_ignored):
    """The ``skillclaw`` trainer factory (``reef_register_trainers``); ``recipe`` is the RecipeConfig."""
    return SkillClawTrainer(scenario, SkillClawOptions.from_config(recipe.options if recipe is not None else None),
                            context)
