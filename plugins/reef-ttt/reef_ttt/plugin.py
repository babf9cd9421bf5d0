"""Hook implementations of reef-ttt, loaded through the ``reef`` entry point.

Factories import their modules on first use, so listing plugins (``reef plugins``) does not pull in torch.
"""

from __future__ import annotations

from reef_core.api import hookimpl


def make_trainer(**kwargs):
    """``ttt`` trainer factory (see :func:`reef_ttt.trainer.make_ttt_trainer`)."""
    from reef_ttt.trainer import make_ttt_trainer

    return make_ttt_trainer(**kwargs)


def make_report_schema(**kwargs):
    from reef_ttt.schema import make_ttt_report_schema

    return make_ttt_report_schema(**kwargs)


def plan_route(view, query):
    from reef_ttt.routes import plan

    return plan(view, query)


def archive_route(view, query):
    from reef_ttt.routes import archive

    return archive(view, query)


@hookimpl
def reef_config_searchpath():
    return "pkg://reef_ttt.conf"


def check_trainer_options(*, recipe):
    """``recipe.options`` as the trainer parses them, at start-up (a typo'd key is refused then)."""
    from reef_ttt.options import TTTOptions

    TTTOptions.from_options(recipe.options)


@hookimpl
def reef_register_trainers(register):
    register("ttt", make_trainer, check_options=check_trainer_options,
             description="TTT-Discover / Guidance-TTT: PUCT archive + entropic LOO advantages + KL to the base, "
                         "un-clipped IS, one LoRA step per complete grid")


@hookimpl
def reef_register_report_schemas(register):
    register("ttt", make_report_schema,
             description="one grid rollout per report: a finite score, one receipt, metadata.state")


@hookimpl
def reef_register_scenario_routes(register):
    register("ttt/plan", plan_route, description="the step to report, its PUCT parents and their prompts")
    register("ttt/archive", archive_route, description="the archive's best state, size and best-score history")
