"""The public API of reef-core: the one module a plugin imports.

Everything a recipe, engine, trainer, evaluator or surface package needs is named here: the hook
marker, the contracts a plugin implements or receives, the errors it may raise and the helpers it
may call. Other ``reef_core`` modules are internal and may move between releases; a test keeps every
package under ``plugins/`` on this line (their tests may also use ``reef_core.testing``). Nothing is defined here:
each name is re-exported from its home (the imports below, or ``_LAZY``), so a definition that moves changes a line
of this file, not a plugin.

The torch-backed names (:class:`Objective`, :class:`TokenBatch`, the loss functions,
:class:`TorchTrainer`, :func:`build_tiny_model`...) and the HTTP clients (:class:`UpstreamEngine`,
the chat models) are imported on first use (PEP 562), so ``import reef_core.api`` is cheap and works
on an install without ``reef-core[train]``.

Hooks and their arguments are documented in :mod:`reef_core.hookspecs`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from reef_core import hookimpl
from reef_core.commit.gate import Candidate, Current, Decision, EvaluationResult, Evaluator, SelectionPolicy
from reef_core.commit.release import Release, scenario_key, scenario_path
from reef_core.commit.store import ArtifactStore, FileValue
from reef_core.config.options import option_values
from reef_core.content import content_text
from reef_core.plugins import load_callable, load_object
from reef_core.engines.base import (
    DirectResponse,
    Engine,
    EngineRequest,
    EngineResponse,
    StreamEvent,
    TokenData,
)
from reef_core.engines.capabilities import AdapterSink, WeightSink
from reef_core.engines.translate import translate_request, translate_response
from reef_core.errors import (
    ConfigError,
    Conflict,
    NotFound,
    PayloadTooLarge,
    PluginError,
    ReefError,
    StorageUnavailable,
    UnknownComponent,
    UpstreamError,
    UpstreamTimeout,
    ValidationFailed,
)
from reef_core.grow.trainer import CandidateUpdate, TrainContext, Trainer, TrainerSetup
from reef_core.observe.model import Record
from reef_core.observe.processor import Batch, Processor, Sample, Segment
from reef_core.background import serve_asgi
from reef_core.serve.process.server import serve_reef
from reef_core.surfaces.base import RunAsync, ServingPorts, Surface
from reef_core.surfaces.adapters import HarnessAdapter, ModelBinding
from reef_core.surfaces.harness import (
    SEPARATOR,
    encode_tree,
    inject_system,
    render_system_prompt,
    validate_harness_path,
    validate_tree,
)
from reef_core.surfaces.skills import (
    CATALOG_OPEN,
    SKILLS_DIR,
    Skill,
    credential_problem,
    parse_skill,
    pool_files,
    render_catalog,
    render_skill,
    skill_path,
    validate_pool,
    validate_slug,
)
from reef_core.versions import ServedVersion

# name -> module, imported on first access: the torch-backed names need ``reef-core[train]``, and the
# HTTP client stack (aiohttp) is not worth importing for every plugin that only registers hooks.
_LAZY = {
    # the typed config sections a component factory receives (composed once at start-up)
    "ReefConfig": "reef_core.config.schema",
    "ServerConfig": "reef_core.config.schema",
    "StorageConfig": "reef_core.config.schema",
    "EngineConfig": "reef_core.config.schema",
    "TrainerConfig": "reef_core.config.schema",
    "EvaluationConfig": "reef_core.config.schema",
    "RecipeConfig": "reef_core.config.schema",
    # what a recipe's scenario route handler reads (reef_register_scenario_routes)
    "ScenarioView": "reef_core.loop.ports",
    # the Python client of a running server (receipts under the provider SDKs, reports, harness pulls)
    "ReefClient": "reef_core.client",
    "AsyncReefClient": "reef_core.client",
    "ReefClientError": "reef_core.client",
    "ReefProcess": "reef_core.client.server_process",
    "UpstreamEngine": "reef_core.engines.upstream",
    "ChatModel": "reef_core.chat",
    "CallableChat": "reef_core.chat",
    "HttpChat": "reef_core.chat",
    "EngineChat": "reef_core.chat",
    "reply_text": "reef_core.chat",
    "resolve_chat_model": "reef_core.chat",
    # the next-state processor a recipe configures, and the dialect-free view of a chat record it correlates with
    "NextStateProcessor": "reef_core.observe.processors.next_state",
    "exchange_of": "reef_core.observe.processors.conversation",
    "common_prefix": "reef_core.observe.processors.conversation",
    "Objective": "reef_core.grow.objective",
    "Prepared": "reef_core.grow.objective",
    "ValueModel": "reef_core.grow.objective",
    "sequence_logprobs": "reef_core.grow.objective",
    "token_sum": "reef_core.grow.objective",
    "action_logits": "reef_core.grow.objective",
    "ReferenceModel": "reef_core.grow.reference",
    "ReferenceScores": "reef_core.grow.reference",
    "TokenBatch": "reef_core.grow.token_batch",
    "TokenRow": "reef_core.grow.token_batch",
    "TokenDataError": "reef_core.grow.token_batch",
    "row_from_sample": "reef_core.grow.token_batch",
    "row_from_tokens": "reef_core.grow.token_batch",
    "ENTROPIC_TARGET_KL": "reef_core.grow.losses",
    "entropic_adaptive_beta_loo": "reef_core.grow.losses",
    "entropic_beta": "reef_core.grow.losses",
    "entropic_kl": "reef_core.grow.losses",
    "entropic_loo": "reef_core.grow.losses",
    "dis_weight": "reef_core.grow.losses",
    "explained_variance": "reef_core.grow.losses",
    "length_adaptive_lambda": "reef_core.grow.losses",
    "skip_observation_gae": "reef_core.grow.losses",
    "clipped_surrogate": "reef_core.grow.losses",
    "grpo_advantages": "reef_core.grow.losses",
    "centered_kl_advantages": "reef_core.grow.losses",
    "TorchTrainer": "reef_core.grow.torch_backend",
    "TorchTrainerOptions": "reef_core.grow.torch_backend",
    "adamw": "reef_core.grow.optim",
    "clipped_step": "reef_core.grow.optim",
    "build_tiny_model": "reef_core.models.loading",
    "build_tiny_tokenizer": "reef_core.models.loading",
}

if TYPE_CHECKING:
    from reef_core.chat import CallableChat, ChatModel, EngineChat, HttpChat, reply_text, resolve_chat_model
    from reef_core.config.schema import (
        EngineConfig,
        EvaluationConfig,
        RecipeConfig,
        ReefConfig,
        ServerConfig,
        StorageConfig,
        TrainerConfig,
    )
    from reef_core.client.server_process import ReefProcess
    from reef_core.client import AsyncReefClient, ReefClient, ReefClientError
    from reef_core.engines.upstream import UpstreamEngine
    from reef_core.loop.ports import ScenarioView
    from reef_core.observe.processors.conversation import common_prefix, exchange_of
    from reef_core.observe.processors.next_state import NextStateProcessor
    from reef_core.grow.losses import (
        ENTROPIC_TARGET_KL,
        centered_kl_advantages,
        clipped_surrogate,
        dis_weight,
        entropic_adaptive_beta_loo,
        entropic_beta,
        entropic_kl,
        entropic_loo,
        explained_variance,
        grpo_advantages,
        length_adaptive_lambda,
        skip_observation_gae,
    )
    from reef_core.models.loading import build_tiny_model, build_tiny_tokenizer
    from reef_core.grow.objective import Objective, Prepared, ValueModel, action_logits, sequence_logprobs, token_sum
    from reef_core.grow.optim import adamw, clipped_step
    from reef_core.grow.reference import ReferenceModel, ReferenceScores
    from reef_core.grow.token_batch import TokenBatch, TokenDataError, TokenRow, row_from_sample, row_from_tokens
    from reef_core.grow.torch_backend import TorchTrainer, TorchTrainerOptions


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reef_core.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    # hooks and the config sections component factories receive
    "hookimpl",
    "ReefConfig", "ServerConfig", "StorageConfig", "EngineConfig", "TrainerConfig", "EvaluationConfig", "RecipeConfig",
    # observe: what a processor receives and emits
    "Record", "Processor", "Segment", "Sample", "Batch",
    "NextStateProcessor", "exchange_of", "common_prefix",
    # grow: trainers and what they hand to the gate
    "Trainer", "TrainerSetup", "TrainContext", "CandidateUpdate",
    "Objective", "Prepared", "ValueModel", "sequence_logprobs", "action_logits", "token_sum",
    "ReferenceModel", "ReferenceScores",
    "TokenBatch", "TokenRow", "TokenDataError", "row_from_sample", "row_from_tokens",
    "dis_weight", "clipped_surrogate", "grpo_advantages", "centered_kl_advantages",
    "explained_variance", "length_adaptive_lambda", "skip_observation_gae",
    "entropic_beta", "entropic_loo", "entropic_kl", "entropic_adaptive_beta_loo", "ENTROPIC_TARGET_KL",
    "TorchTrainer", "TorchTrainerOptions", "adamw", "clipped_step", "build_tiny_model", "build_tiny_tokenizer",
    # commit: the gate and the release chain
    "Candidate", "Current", "Decision", "EvaluationResult", "Evaluator", "SelectionPolicy",
    "ArtifactStore", "FileValue", "Release", "scenario_key", "scenario_path",
    # serve: surfaces and engines
    "Surface", "ServingPorts", "RunAsync", "ScenarioView", "HarnessAdapter", "ModelBinding", "ServedVersion",
    "Engine", "EngineRequest", "EngineResponse", "StreamEvent", "TokenData", "DirectResponse", "WeightSink", "AdapterSink",
    "UpstreamEngine", "translate_request", "translate_response",
    # helpers
    "load_object", "load_callable", "option_values", "serve_asgi", "serve_reef", "content_text",
    "ReefClient", "AsyncReefClient", "ReefClientError", "ReefProcess",
    "ChatModel", "CallableChat", "HttpChat", "EngineChat", "reply_text", "resolve_chat_model",
    "SEPARATOR", "encode_tree", "inject_system", "render_system_prompt", "validate_harness_path", "validate_tree",
    "Skill", "SKILLS_DIR", "CATALOG_OPEN", "credential_problem", "parse_skill", "pool_files", "render_catalog",
    "render_skill", "skill_path", "validate_pool", "validate_slug",
    # errors
    "ReefError", "ConfigError", "ValidationFailed", "UpstreamError", "UpstreamTimeout", "NotFound", "Conflict",
    "PayloadTooLarge", "PluginError", "UnknownComponent", "StorageUnavailable",
]
