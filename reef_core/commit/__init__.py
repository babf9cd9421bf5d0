"""commit: the storage half of the release chain (git + git-lfs releases, commit log, gate).

Names are imported lazily (PEP 562), so ``import reef_core.commit.git_store`` in a worker
process does not pay for the gate's dependencies (jsonschema) and vice versa.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "check_git_lfs": "_git",
    "CommitLog": "commitlog",
    "LogLocked": "commitlog",
    "WriterLock": "commitlog",
    "Committer": "committer",
    "ReplayEvaluator": "evaluators",
    "TaskEvaluator": "evaluators",
    "exact_match": "evaluators",
    "json_schema": "evaluators",
    "python_verifier": "evaluators",
    "regex_match": "evaluators",
    "Candidate": "gate",
    "Current": "gate",
    "Decision": "gate",
    "EvaluationResult": "gate",
    "Evaluator": "gate",
    "Gate": "gate",
    "SelectionPolicy": "gate",
    "run_gate": "gate",
    "GitArtifactStore": "git_store",
    "Always": "policies",
    "Floor": "policies",
    "PairedConfidence": "policies",
    "ScoreComparison": "policies",
    "always": "policies",
    "floor": "policies",
    "make_policy": "policies",
    "paired_confidence": "policies",
    "score_comparison": "policies",
    "sign_test_p_value": "policies",
    "RecoveryResult": "recovery",
    "reconcile": "recovery",
    "Release": "release",
    "GcPlan": "retention",
    "GcResult": "retention",
    "RetentionPolicy": "retention",
    "plan_gc": "retention",
    "run_gc": "retention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
