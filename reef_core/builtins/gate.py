"""Built-in evaluators and selection policies of the evaluation gate."""

from __future__ import annotations

import importlib

from .. import hookimpl


def _lazy(module: str, attr: str):
    # Import on first use: listing plugins must not import the gate's dependencies.
    def factory(**options):
        return getattr(importlib.import_module(module), attr)(**options)

    factory.__qualname__ = f"{module}.{attr}"
    return factory


@hookimpl
def reef_register_selection_policies(register):
    policies = "reef_core.commit.policies"
    register("always", _lazy(policies, "AlwaysSelect"), description="select every candidate")
    register("score_comparison", _lazy(policies, "ScoreComparison"),
             description="candidate vs current on the same tasks: wins - losses > margin")
    register("paired_confidence", _lazy(policies, "PairedConfidence"),
             description="one-sided sign test + seeded bootstrap over paired task scores")
    register("floor", _lazy(policies, "Floor"), description="candidate reaches a floor score on every task")


@hookimpl
def reef_register_evaluators(register):
    evaluators = "reef_core.commit.evaluators"
    register("exact_match", _lazy(evaluators, "ExactMatch"), description="output equals the expected answer")
    register("regex", _lazy(evaluators, "RegexMatch"), description="output matches a regular expression")
    register("json_schema", _lazy(evaluators, "JsonSchemaMatch"), description="output is JSON valid against a schema")
    register("python", _lazy(evaluators, "PythonVerifier"), description="a verifier function named by dotted path")
    register("replay", _lazy(evaluators, "Replay"), description="replay held-out recorded tasks with their scores")
