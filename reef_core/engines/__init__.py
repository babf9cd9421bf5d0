"""Inference engines: what talks to models.

* :mod:`~reef_core.engines.base`: the :class:`Engine` interface and its data types;
* :mod:`~reef_core.engines.upstream`: :class:`UpstreamEngine`, an HTTP proxy to an OpenAI/Anthropic provider;
* :mod:`~reef_core.engines.local`: :class:`LocalEngine`, a transformers model served in-process
  (imported lazily: it pulls in torch);
* :mod:`~reef_core.engines.remote`: :class:`RemoteEngine`, what the HTTP serving engines share (token capture,
  versioned weight updates, per-version LoRA, admission and drain, retries);
* :mod:`~reef_core.engines.sglang` / :mod:`~reef_core.engines.vllm`: :class:`SGLangEngine` (native ``/generate``) and
  :class:`VLLMEngine` (``/v1/completions`` from token ids), its protocols; :mod:`~reef_core.engines.launch` starts a
  server;
* :mod:`~reef_core.engines.translate`: OpenAI <-> Anthropic request/response/stream translation;
* :mod:`~reef_core.engines.bridge`: :class:`DialectBridge`, any engine serving both dialects;
* :mod:`~reef_core.engines.sse`: incremental SSE decoding and encoding.
"""

from reef_core.engines.base import (
    HEADERS_EVENT,
    RELAYED_STATUSES,
    TOKENS_EVENT,
    Dialect,
    DirectResponse,
    Engine,
    EngineRequest,
    EngineResponse,
    StreamEvent,
    TokenData,
)

__all__ = [
    "HEADERS_EVENT", "RELAYED_STATUSES", "TOKENS_EVENT", "Dialect", "DirectResponse", "Engine", "EngineRequest",
    "EngineResponse", "StreamEvent", "TokenData", "DialectBridge", "UpstreamEngine", "LocalEngine",
]


# Imported on first use: torch (LocalEngine) is an extra, and the HTTP client stack (aiohttp) is not
# worth importing for a plugin that only needs the Engine contract.
_LAZY = {"LocalEngine": "reef_core.engines.local", "UpstreamEngine": "reef_core.engines.upstream",
         "DialectBridge": "reef_core.engines.bridge"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
