"""Hook implementations of reef-sao, loaded through the ``reef`` entry point.

Factories import their modules on first use, so listing plugins (``reef plugins``) does not pull in torch.
"""

from __future__ import annotations

from reef_core.api import hookimpl


def make_trainer(**kwargs):
    """``sao`` trainer factory (see :func:`reef_sao.trainer.make_sao_trainer`)."""
    from reef_sao.trainer import make_sao_trainer

    return make_sao_trainer(**kwargs)


def make_report_schema(**kwargs):
    """``sao`` report schema factory (see :func:`reef_sao.schema.validate_sao_report`)."""
    from reef_sao.schema import make_sao_report_schema

    return make_sao_report_schema(**kwargs)


def check_trainer_options(*, recipe):
    """The trainer's options (and the processor's batch beside them) as start-up checks them."""
    from reef_sao.options import SAOOptions

    SAOOptions.from_options(recipe.options, recipe.processor_options)


@hookimpl
def reef_config_searchpath():
    return "pkg://reef_sao.conf"


@hookimpl
def reef_register_trainers(register):
    register("sao", make_trainer, check_options=check_trainer_options,
             description="SAO: critic + skip-observation GAE + DIS loss on full weights or LoRA "
                         "(recipe.options.advantage=grpo: the GRPO-with-DIS control arm)")


@hookimpl
def reef_register_report_schemas(register):
    register("sao", make_report_schema,
             description="one scored rollout per report: a finite score and exactly one receipt")
