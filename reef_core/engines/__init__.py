"""Inference engines: what talks to models.

* :mod:`~reef_core.engines.base`: the :class:`Engine` interface and its data types;
* :mod:`~reef_core.engines.upstream`: :class:`UpstreamEngine`, an HTTP proxy to an OpenAI/Anthropic provider;
* :mod:`~reef_core.engines.local`: :class:`LocalEngine`, a transformers model served in-process
  (imported lazily: it pulls in torch);
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
from reef_core.engines.bridge import DialectBridge
from reef_core.engines.upstream import UpstreamEngine

__all__ = [
    "HEADERS_EVENT", "RELAYED_STATUSES", "TOKENS_EVENT", "Dialect", "DirectResponse", "Engine", "EngineRequest",
    "EngineResponse", "StreamEvent", "TokenData", "DialectBridge", "UpstreamEngine", "LocalEngine",
]


def __getattr__(name: str):
    if name == "LocalEngine":  # lazy: torch is heavy and proxy-only deployments do not need it
        from reef_core.engines.local import LocalEngine

        return LocalEngine
    raise AttributeError(name)
