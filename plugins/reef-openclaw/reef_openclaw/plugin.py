"""Hook implementations of reef-openclaw, loaded through the ``reef`` entry point.

Factories import their modules on first use, so listing plugins (``reef plugins``) does not pull in torch.
"""

from __future__ import annotations

from reef_core.api import hookimpl


def make_processor(**kwargs):
    """``openclaw`` processor factory (see :func:`reef_openclaw.processor.make_openclaw_processor`)."""
    from reef_openclaw.processor import make_openclaw_processor

    return make_openclaw_processor(**kwargs)


def make_prm_judge(**kwargs):
    """``prm`` judge factory (see :func:`reef_openclaw.prm.make_prm_judge`)."""
    from reef_openclaw.prm import make_prm_judge as make

    return make(**kwargs)


def make_callable_judge(**kwargs):
    """``callable`` judge factory (see :func:`reef_openclaw.judges.make_callable_judge`)."""
    from reef_openclaw.judges import make_callable_judge as make

    return make(**kwargs)


def make_trainer(**kwargs):
    """``openclaw`` trainer factory (see :func:`reef_openclaw.trainer.make_openclaw_trainer`)."""
    from reef_openclaw.trainer import make_openclaw_trainer

    return make_openclaw_trainer(**kwargs)


def check_trainer_options(*, recipe):
    """``recipe.options`` (and the processor's batch beside them) as the trainer parses them, at start-up."""
    from reef_openclaw.options import OpenClawOptions

    OpenClawOptions.from_options(recipe.options, recipe.processor_options)


def check_processor_options(*, recipe):
    """``recipe.processor_options`` keys as the processor reads them, at start-up."""
    from reef_openclaw.processor import check_options

    check_options(recipe.processor_options)


@hookimpl
def reef_config_searchpath():
    return "pkg://reef_openclaw.conf"


@hookimpl
def reef_register_processors(register):
    register("openclaw", make_processor, check_options=check_processor_options,
             description="next_state correlation + a registered judge + OpenClaw-RL's dispatch (score, hints)")


@hookimpl
def reef_register_judges(register):
    register("prm", make_prm_judge,
             description="m boxed votes of a chat model (plurality score) plus hint votes between markers")
    register("callable", make_callable_judge,
             description="a Python function judge(turn=..., next_state=...) -> {score, hint}")


@hookimpl
def reef_register_trainers(register):
    register("openclaw", make_trainer, check_options=check_trainer_options,
             description="OpenClaw-RL: PPO-clip on the judged reward + top-K OPD toward the hinted frozen base")
