"""Test support shipped with reef-core: fakes for CPU tests and benchmarks (never used in production).

Besides the fake upstream and the fake SGLang and vLLM servers, this namespace gives tests of plugin packages the internal pieces they
assemble by hand (config composition, a plugin manager, a committer over a git store, the gate...),
so that plugin code imports :mod:`reef_core.api` only and plugin tests ``reef_core.api`` and
``reef_core.testing``. Names are resolved lazily, so that ``python -m reef_core.testing.fake_upstream``
does not import the module twice and nothing here needs torch until it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> (module, attribute; None for the module itself)
_EXPORTS = {
    "FakeUpstream": ("reef_core.testing.fake_upstream", "FakeUpstream"),
    "FakeUpstreamControl": ("reef_core.testing.fake_upstream", "FakeUpstreamControl"),
    "serve_fake_upstream": ("reef_core.testing.fake_upstream", "serve_fake_upstream"),
    "run_fake_upstream": ("reef_core.testing.fake_upstream", "run_fake_upstream"),
    "serve_asgi": ("reef_core.background", "serve_asgi"),
    "FakeSGLang": ("reef_core.testing.fake_sglang", "FakeSGLang"),
    "serve_fake_sglang": ("reef_core.testing.fake_sglang", "serve_fake_sglang"),
    "FakeVLLM": ("reef_core.testing.fake_vllm", "FakeVLLM"),
    "serve_fake_vllm": ("reef_core.testing.fake_vllm", "serve_fake_vllm"),
    "ensure_tiny_model": ("reef_core.models.loading", "ensure_tiny_model"),
    "wait_until": ("reef_core.testing.fixtures", "wait_until"),
    "learn_in_rounds": ("reef_core.testing.fixtures", "learn_in_rounds"),
    "compose_config": ("reef_core.config", "compose_config"),
    "available_recipes": ("reef_core.config", "available_recipes"),
    "PluginManager": ("reef_core.plugins", "PluginManager"),
    "builtin_trainers": ("reef_core.builtins.trainers", None),
    "CommitLog": ("reef_core.commit.commitlog", "CommitLog"),
    "Committer": ("reef_core.commit.committer", "Committer"),
    "GitArtifactStore": ("reef_core.commit.git_store", "GitArtifactStore"),
    "run_gate": ("reef_core.commit.gate", "run_gate"),
    "ScoreComparison": ("reef_core.commit.policies", "ScoreComparison"),
    "TaskEvaluator": ("reef_core.commit.evaluators", "TaskEvaluator"),
    "python_verifier": ("reef_core.commit.evaluators", "python_verifier"),
    "PerReportProcessor": ("reef_core.observe.processors", "PerReportProcessor"),
    "HarnessSurface": ("reef_core.surfaces.harness", "HarnessSurface"),
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    import reef_core.builtins.trainers as builtin_trainers  # noqa: F401
    from reef_core.commit.commitlog import CommitLog  # noqa: F401
    from reef_core.commit.committer import Committer  # noqa: F401
    from reef_core.commit.evaluators import TaskEvaluator, python_verifier  # noqa: F401
    from reef_core.commit.gate import run_gate  # noqa: F401
    from reef_core.commit.git_store import GitArtifactStore  # noqa: F401
    from reef_core.commit.policies import ScoreComparison  # noqa: F401
    from reef_core.config import available_recipes, compose_config  # noqa: F401
    from reef_core.observe.processors import PerReportProcessor  # noqa: F401
    from reef_core.plugins import PluginManager  # noqa: F401
    from reef_core.background import serve_asgi  # noqa: F401
    from reef_core.surfaces.harness import HarnessSurface  # noqa: F401
    from reef_core.testing.fake_upstream import (  # noqa: F401
        FakeUpstream,
        FakeUpstreamControl,
        run_fake_upstream,
        serve_fake_upstream,
    )
    from reef_core.models.loading import ensure_tiny_model  # noqa: F401
    from reef_core.testing.fake_sglang import FakeSGLang, serve_fake_sglang  # noqa: F401
    from reef_core.testing.fake_vllm import FakeVLLM, serve_fake_vllm  # noqa: F401
    from reef_core.testing.fixtures import learn_in_rounds, wait_until  # noqa: F401


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    module, attr = _EXPORTS[name]
    loaded = importlib.import_module(module)
    return loaded if attr is None else getattr(loaded, attr)
