"""DialectBridge: make any engine serve both client dialects by translating on the fly.

A request in a dialect the inner engine speaks goes straight through. Otherwise the request body is
translated (:mod:`reef_core.engines.translate`), the inner engine is called in its own dialect, and the
answer comes back in the client's dialect: response bodies, relayed error bodies and streams (with
the stateful stream translators). ``reef.*`` events and token data pass through unchanged.
"""

from __future__ import annotations

from typing import AsyncIterator

from reef_core.engines.base import (
    GENERATE_ROUTE,
    DirectResponse,
    Engine,
    EngineRequest,
    EngineResponse,
    StreamEvent,
)
from reef_core.engines.translate import (
    DEFAULT_MAX_TOKENS,
    anthropic_count_tokens_to_openai,
    stream_translator,
    translate_error,
    translate_request,
    translate_response,
)
from reef_core.errors import ValidationFailed


class DialectBridge(Engine):
    """Wrap ``inner`` so that it answers OpenAI and Anthropic requests alike.

    ``default_max_tokens`` fills Anthropic's required ``max_tokens`` when an OpenAI request without one
    is sent to an Anthropic-speaking engine.
    """

    dialects = ("openai", "anthropic")

    def __init__(self, inner: Engine, default_max_tokens: int = DEFAULT_MAX_TOKENS):
        self.inner = inner
        self.name = inner.name
        self.default_max_tokens = default_max_tokens

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def model_ids(self) -> list[str]:
        return self.inner.model_ids()

    def _target(self, req: EngineRequest) -> tuple[str, EngineRequest] | None:
        """None when the inner engine speaks the request's dialect; else (inner dialect, translated request)."""
        if req.dialect not in self.dialects:
            raise ValidationFailed(f"unknown dialect {req.dialect!r}")
        if req.dialect in self.inner.dialects:
            return None
        dst = self.inner.dialects[0]
        body = translate_request(req.body, req.dialect, dst, self.default_max_tokens)
        return dst, EngineRequest(dst, GENERATE_ROUTE[dst], body, dict(req.headers), req.version, req.tokens)

    def _back(self, resp: EngineResponse, src: str, dst: str) -> EngineResponse:
        if 200 <= resp.status < 300:
            body = translate_response(resp.body, src, dst)
        else:
            body = translate_error(resp.body, resp.status, dst)
        return EngineResponse(resp.status, body, resp.headers, resp.tokens, resp.version)

    async def complete(self, req: EngineRequest) -> EngineResponse:
        if req.route == "count_tokens":
            return await self.count_tokens(req)
        target = self._target(req)
        if target is None:
            return await self.inner.complete(req)
        dst, inner_req = target
        return self._back(await self.inner.complete(inner_req), dst, req.dialect)

    async def stream(self, req: EngineRequest) -> AsyncIterator[StreamEvent]:
        target = self._target(req)
        if target is None:
            async for ev in self.inner.stream(req):
                yield ev
            return
        dst, inner_req = target
        include_usage = bool((req.body.get("stream_options") or {}).get("include_usage"))
        tr = stream_translator(dst, req.dialect, include_usage=include_usage, model=req.body.get("model"))
        try:
            async for ev in self.inner.stream(inner_req):
                for out in tr.feed(ev):
                    yield out
            for out in tr.finish():  # normally nothing: the terminal event already closed the stream
                yield out
        except DirectResponse as d:
            raise DirectResponse(self._back(d.response, dst, req.dialect)) from None

    async def count_tokens(self, req: EngineRequest) -> EngineResponse:
        if req.dialect in self.inner.dialects:
            return await self.inner.count_tokens(req)
        if req.dialect == "anthropic":
            body = anthropic_count_tokens_to_openai(req.body)
            inner_req = EngineRequest("openai", "count_tokens", body, req.headers, req.version)
            return await self.inner.count_tokens(inner_req)
        body = translate_request(req.body, "openai", "anthropic", self.default_max_tokens)
        body = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools", "tool_choice")}
        return await self.inner.count_tokens(EngineRequest("anthropic", "count_tokens", body, req.headers, req.version))
