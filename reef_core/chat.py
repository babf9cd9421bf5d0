"""Chat models a plugin calls: ``model(messages) -> str`` with OpenAI-style chat messages.

Recipes that ask a language model for something (GEPA's task and reflection models) configure it as
one of:

* ``null`` or ``served``: the deployment's engine (``TrainerSetup.engine``), the model Reef serves;
* ``"pkg.module:function"``: a Python callable ``function(messages) -> str`` (tests, stand-ins);
* ``{url, model, api_key_env, timeout_s, request}``: any OpenAI-compatible endpoint
  (``POST {url}/v1/chat/completions``); ``request`` holds extra body fields (temperature...).

:func:`resolve_chat_model` builds one from that config.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from reef_core.content import content_text
from reef_core.plugins import load_object
from reef_core.engines.base import EngineRequest
from reef_core.engines.translate import translate_request, translate_response
from reef_core.engines.upstream import UpstreamEngine
from reef_core.errors import ConfigError, UpstreamError


class ChatModel(Protocol):
    def __call__(self, messages: list[dict]) -> str: ...


def reply_text(body: Any) -> str:
    """The assistant text of an OpenAI chat completion body."""
    try:
        content = body["choices"][0]["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise UpstreamError("the model answered without a chat completion message") from None
    # The reply's words; a reply of other parts (audio...) has no text for the caller.
    return content_text(content, non_text="skip")


class CallableChat:
    """A Python function as a chat model."""

    def __init__(self, func: Callable[[list[dict]], Any], name: str = "callable"):
        self.func = func
        self.name = name

    def __call__(self, messages: list[dict]) -> str:
        out = self.func(messages)
        if not isinstance(out, str):
            raise UpstreamError(f"chat model {self.name} returned {type(out).__name__}, not text")
        return out


class HttpChat:
    """An OpenAI-compatible endpoint, called synchronously (trainers run off the event loop).

    Plain ``urllib`` (no proxy from the environment): a blocking call from a worker thread needs no
    client library."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout_s: float = 300.0,
                 request: Mapping[str, Any] | None = None):
        base = url.rstrip("/")
        self.url = (base[:-3] if base.endswith("/v1") else base) + "/v1/chat/completions"
        self.model = model or "reef"
        self.extra = dict(request or {})
        self.timeout_s = timeout_s
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __call__(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, **self.extra, "messages": messages}).encode()
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            raise UpstreamError(f"{self.url} answered {exc.code}: {exc.read()[:300].decode(errors='replace')}") from exc
        except (OSError, urllib.error.URLError) as exc:
            raise UpstreamError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            return reply_text(json.loads(payload))
        except ValueError:
            raise UpstreamError(f"{self.url} answered a body that is not JSON") from None

    def close(self) -> None:
        """Nothing to release (one connection per call); kept so callers may close any model."""


class EngineChat:
    """The deployment's engine (the served model) as a chat model.

    Engines are async and their connections belong to the server's event loop; ``run_async(coroutine)``
    (the deployment's) runs a coroutine there from this worker thread. Without it, an upstream engine
    is called through a twin (same URL, key, dialect and model) living on a private event-loop thread,
    so no connection of the server's pool ever crosses loops; other engines (the local one hands work
    to its own thread) run on a fresh loop per call.
    """

    def __init__(self, engine: Any, run_async: Callable[[Any], Any] | None = None, model: str | None = None,
                 request: Mapping[str, Any] | None = None, max_tokens: int = 1024):
        if engine is None:
            raise ConfigError("no served engine to run the chat model on; configure an endpoint or a callable")
        self.engine = engine
        self.run_async = run_async
        self.model = model
        self.extra = dict(request or {})
        self.max_tokens = max_tokens
        self._twin_lock = threading.Lock()
        self._twin: UpstreamEngine | None = None
        self._loop: _PrivateLoop | None = None

    def __call__(self, messages: list[dict]) -> str:
        body = {"model": self.model or _first_model(self.engine), **self.extra, "messages": messages}
        dialect = "openai" if "openai" in self.engine.dialects else self.engine.dialects[0]
        request = EngineRequest(dialect=dialect, route="chat" if dialect == "openai" else "messages",
                                body=translate_request(body, "openai", dialect, self.max_tokens))
        result = self._complete(request)
        if result.status >= 400:
            raise UpstreamError(f"the served model answered {result.status}: {str(result.body)[:300]}")
        return reply_text(translate_response(result.body, dialect, "openai"))

    def _complete(self, request: EngineRequest):
        if self.run_async is not None:
            return self.run_async(self.engine.complete(request))
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("EngineChat called on an event loop thread; run the trainer in a worker thread")
        if isinstance(self.engine, UpstreamEngine):
            return self._twin_loop().run(self._twin_complete(request))
        return asyncio.run(self.engine.complete(request))

    def _twin_loop(self) -> "_PrivateLoop":
        with self._twin_lock:
            if self._loop is None:
                engine = self.engine
                self._twin = UpstreamEngine(engine.url, engine.api_key, engine.dialect, engine.timeout_s, engine.model,
                                            name=f"{engine.name}:chat", max_connections=8)
                self._loop = _PrivateLoop()
            return self._loop

    async def _twin_complete(self, request: EngineRequest):
        await self._twin.start()
        return await self._twin.complete(request)


class _PrivateLoop:
    """An event loop on a daemon thread, for async clients that must never touch the server's loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="reef-chat-engine", daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


def _first_model(engine: Any) -> str:
    try:
        ids = engine.model_ids()
    except Exception:  # noqa: BLE001
        ids = []
    return ids[0] if ids else "reef"


def resolve_chat_model(spec: Any, *, engine: Any = None, run_async: Callable[[Any], Any] | None = None,
                       what: str = "model") -> ChatModel:
    """Build a chat model from its config (see the module docstring)."""
    if spec is None or spec == "served":
        return EngineChat(engine, run_async)
    if isinstance(spec, str):
        func = load_object(spec)
        if not callable(func):
            raise ConfigError(f"{what}: {spec!r} is not callable")
        return CallableChat(func, spec)
    if callable(spec):
        return CallableChat(spec, getattr(spec, "__name__", what))
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if spec.get("callable"):
            return resolve_chat_model(str(spec["callable"]), what=what)
        if spec.get("kind") == "served" or not spec.get("url"):
            return EngineChat(engine, run_async, model=spec.get("model"), request=spec.get("request"))
        env = spec.get("api_key_env")
        api_key = os.environ.get(str(env)) if env else None
        return HttpChat(str(spec["url"]), spec.get("model"), api_key, float(spec.get("timeout_s", 300)),
                        spec.get("request"))
    raise ConfigError(f"{what}: expected null, 'served', a dotted callable or {{url, model}}, got {spec!r}")
