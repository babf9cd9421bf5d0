"""Hook implementations of reef-gepa, loaded through the ``reef`` entry point.

The recipe (``+recipe=gepa``, ``conf/recipe/gepa.yaml``) combines Reef's built-in ``per_report``
processor (``processor_options.batch_size`` = the GEPA minibatch), the ``gepa`` trainer registered
here and Reef's built-in ``harness`` surface. ``+recipe=gepa_dspy`` (``conf/recipe/gepa_dspy.yaml``) compiles
a DSPy program with the ``dspy_gepa`` trainer instead; it needs ``reef-gepa[dspy]``, imported only when such a
trainer is built.
"""

from __future__ import annotations

from reef_core.api import hookimpl


@hookimpl
def reef_config_searchpath():
    return "pkg://reef_gepa.conf"


def _make_trainer(**kwargs):
    from .trainer import make_trainer

    return make_trainer(**kwargs)


def _make_dspy_trainer(**kwargs):
    from .dspy.trainer import make_trainer

    return make_trainer(**kwargs)


def _check_options(*, recipe):
    """``recipe.options`` as the trainer parses them, at start-up (a typo'd key is refused then)."""
    from .options import GepaOptions

    GepaOptions.from_config(recipe.options)


@hookimpl
def reef_register_trainers(register):
    register("gepa", _make_trainer, check_options=_check_options,
             description="GEPA: reflective prompt evolution with a per-task Pareto front (harness text)")
    register("dspy_gepa", _make_dspy_trainer, requires={"dspy": "reef-gepa[dspy]"},
             description="dspy.GEPA: compile a DSPy program on reported records (needs reef-gepa[dspy])")
