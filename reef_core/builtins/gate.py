"""Built-in evaluators and selection policies of the evaluation gate.

Evaluator factories are called as ``factory(tasks=..., run=..., options=...)``: ``tasks`` are
the evaluation tasks (dicts: ``evaluation.tasks``, the trainer's own, or for ``replay`` the
processor's held-out records), ``run(subject, task)`` produces an output for a candidate or the
current release, and ``options`` come from ``evaluation.options``. Selection-policy factories
take the policy's options as keyword arguments.
"""

from __future__ import annotations

from .. import hookimpl


def _task_evaluator(scorer_name: str):
    def factory(*, tasks, run, options=None):
        from ..commit.evaluators import SCORERS, TaskEvaluator

        options = dict(options or {})
        repeats = int(options.pop("repeats", 1))
        scorer = SCORERS[scorer_name](**options)
        return TaskEvaluator(tasks, run, scorer, name=scorer_name, repeats=repeats)

    return factory


def _replay(*, tasks, run, options=None):
    """``tasks`` are the processor's held-out records; ``options.scorer`` names the scorer that judges the
    candidate's replies (``python``, ``exact_match``...), the other options are that scorer's."""
    from ..commit.evaluators import SCORERS, ReplayEvaluator
    from ..errors import ConfigError

    options = dict(options or {})
    scorer_name = options.pop("scorer", None)
    if scorer_name not in SCORERS:
        raise ConfigError(f"the replay evaluator needs evaluation.options.evaluator.scorer, one of "
                          f"{', '.join(sorted(SCORERS))} (got {scorer_name!r})")
    return ReplayEvaluator(tasks, run, SCORERS[scorer_name](**options))


def _policy(name: str):
    def factory(**options):
        from ..commit.policies import make_policy

        return make_policy(name, **options)

    return factory


@hookimpl
def reef_register_selection_policies(register):
    register("always", _policy("always"), description="select every candidate")
    register("score_comparison", _policy("score_comparison"),
             description="candidate vs current on the same tasks: wins - losses > margin")
    register("paired_confidence", _policy("paired_confidence"),
             description="one-sided sign test + seeded bootstrap over paired task scores")
    register("floor", _policy("floor"), description="candidate reaches a floor score on every task")


@hookimpl
def reef_register_evaluators(register):
    register("exact_match", _task_evaluator("exact_match"), description="output equals the task's expected answer")
    register("regex", _task_evaluator("regex"), description="output matches a regular expression")
    register("json_schema", _task_evaluator("json_schema"), description="output is JSON valid against a schema")
    register("python", _task_evaluator("python"), description="a verifier function named by dotted path")
    register("replay", _replay, description="held-out recorded tasks scored against their reported scores")
