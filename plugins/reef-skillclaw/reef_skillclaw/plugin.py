"""Hook implementations of reef-skillclaw, loaded through the ``reef`` entry point.

The recipe (``+recipe=skillclaw``, ``conf/recipe/skillclaw.yaml``) combines Reef's built-in ``per_report``
processor (one sample per graded session; ``batch_size`` sessions make a day), the ``skillclaw`` report
schema and trainer registered here, and Reef's built-in ``skills`` surface.
"""

from __future__ import annotations

from reef_core.api import hookimpl


@hookimpl
def reef_config_searchpath():
    return "pkg://reef_skillclaw.conf"


def _make_trainer(**kwargs):
    from .trainer import make_trainer

    return make_trainer(**kwargs)


def _make_report_schema(**kwargs):
    from .schema import make_report_schema

    return make_report_schema(**kwargs)


def _check_options(*, recipe):
    """``recipe.options`` as the trainer parses them, at start-up (a typo'd key is refused then)."""
    from .options import SkillClawOptions

    SkillClawOptions.from_config(recipe.options)


@hookimpl
def reef_register_trainers(register):
    register("skillclaw", _make_trainer, check_options=_check_options,
             description="SkillClaw: a nightly evolver improves, describes and creates skills of a shared pool")


@hookimpl
def reef_register_report_schemas(register):
    register("skillclaw", _make_report_schema,
             description="one report per graded session: task, category, score or the unscored sentinel")
