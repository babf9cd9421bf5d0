"""UpstreamEngine: proxy requests to an OpenAI- or Anthropic-compatible provider over HTTP.

One pooled ``aiohttp.ClientSession`` (HTTP/1.1, keep-alive) is created by :meth:`start` and reused by
every request (on the event loop that started it). aiohttp rather than httpx: its C parser makes a proxied call
cost about a third of the CPU, and its pool hands out an idle connection in O(1) where httpcore polls every
pooled socket per request. The engine posts the body to the same path upstream (``/v1/chat/completions``,
``/v1/messages``, ``/v1/messages/count_tokens``) under the configured base URL and sets its own
credentials (``Authorization: Bearer`` for OpenAI, ``x-api-key`` + ``anthropic-version`` for
Anthropic); the request can choose neither the URL nor the key. Streams are parsed incrementally
with :class:`reef_core.engines.sse.SSEDecoder`.

Streams start with one ``StreamEvent(event=HEADERS_EVENT, data={provider headers})`` so the server
can copy provider headers before relaying frames; like every ``reef.*`` event it is never relayed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from email.utils import parsedate_to_datetime
from typing import AsyncIterator

import aiohttp
from aiohttp.helpers import basicauth_from_netrc, get_env_proxy_for_url, netrc_from_env
from multidict import CIMultiDictProxy
from yarl import URL

from reef_core.engines.base import (
    HEADERS_EVENT,
    DirectResponse,
    Engine,
    EngineRequest,
    EngineResponse,
    StreamEvent,
    relay_status,
)
from reef_core.content import content_text
from reef_core.engines.sse import SSEDecoder, parse_data
from reef_core.engines.token_count import PromptCounter
from reef_core.wire import HEADER_PREFIX, RECORD_ID_HEADER, ROUTE_PATHS, TOKEN_COUNT_HEADER
from reef_core.engines.translate import error_body, error_message
from reef_core.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable, ValidationFailed

# Request headers never forwarded: hop-by-hop, transport-managed, or credentials (the engine sets its own).
_DROP_REQUEST = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
    "proxy-authorization", "proxy-connection", "authorization", "x-api-key", "accept-encoding", "content-type",
    "cookie",
})
# Response headers never relayed: hop-by-hop and framing (the server re-frames the body) and any receipt.
_DROP_RESPONSE = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server",
    "set-cookie", RECORD_ID_HEADER, "alt-svc", "via", "te", "trailer", "upgrade",
})
_ANTHROPIC_VERSION = "2023-06-01"

log = logging.getLogger("reef.engines.upstream")


def _filter_response_headers(headers: CIMultiDictProxy) -> dict[str, str]:
    """Relayable provider headers, names lower-cased, repeated ones joined with ", " (as httpx did)."""
    out: dict[str, str] = {}
    for k, v in headers.items():
        k = k.lower()
        if k in _DROP_RESPONSE:
            continue
        out[k] = f"{out[k]}, {v}" if k in out else v
    return out


# Failures to reach the provider at all: no byte of the request was sent, so one re-dial is safe.
_CONNECT_ERRORS = (aiohttp.ClientConnectorError,)


def _env_options(url: URL) -> dict:
    """What ``aiohttp.ClientSession(trust_env=True)`` would add to a request for ``url``: the ``proxy`` and
    ``proxy_auth`` of the proxy environment variables (``NO_PROXY`` honoured), and under ``"authorization"`` the
    Basic credentials of a ~/.netrc (or ``$NETRC``) entry for its host. Read at start: a later change to the
    environment is not seen."""
    options: dict = {}
    if url.host is not None and url.user is None:  # credentials in the URL win over netrc, as in aiohttp
        try:
            options["authorization"] = basicauth_from_netrc(netrc_from_env(), url.host).encode()
        except LookupError:
            pass
    try:
        options["proxy"], options["proxy_auth"] = get_env_proxy_for_url(url)
    except LookupError:
        pass
    return options


class UpstreamEngine(Engine):
    """Relay to one provider.

    Args:
        url: provider base URL (``https://api.openai.com`` or ``http://127.0.0.1:30000``); a trailing
            ``/v1`` is accepted and folded into the route paths.
        api_key: the provider key, or None for keyless local servers.
        dialect: ``"openai"`` or ``"anthropic"``, the wire format the provider speaks.
        timeout_s: bound on a whole non-streamed call and on each read of a stream.
        model: when set, replaces the request's ``model`` (the scenario's served model).
        max_connections: size of the connection pool.
        max_response_bytes: a larger non-streamed body (or a single SSE event) is an UpstreamError.
        count_tokens_mode: how an OpenAI-compatible provider answers ``count_tokens`` (see there).
        tokenizer: a model directory with the provider's model's tokenizer (``engine.upstream_tokenizer``): an
            OpenAI-compatible provider's prompts are counted with it (:mod:`reef_core.engines.token_count`).
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        dialect: str = "openai",
        timeout_s: float = 300,
        model: str | None = None,
        *,
        name: str | None = None,
        max_connections: int = 512,
        max_response_bytes: int = 64 * 1024 * 1024,
        connect_timeout_s: float = 10.0,
        anthropic_version: str = _ANTHROPIC_VERSION,
        trust_env: bool = True,
        count_tokens_mode: str = "estimate",
        responses: bool = False,
        tokenizer: str | None = None,
    ):
        if dialect not in ("openai", "anthropic"):
            raise ValidationFailed(f"unknown provider dialect {dialect!r}")
        if count_tokens_mode not in ("estimate", "probe"):
            raise ValidationFailed(f"count_tokens_mode must be 'estimate' or 'probe', not {count_tokens_mode!r}")
        self.count_tokens_mode = count_tokens_mode
        self._counter = PromptCounter(tokenizer) if dialect == "openai" else None
        #: ``engine.upstream_responses``: the provider serves ``/v1/responses`` itself (an OpenAI dialect one), so
        #: Responses requests are passed through instead of translated to chat.
        self.serves_responses = bool(responses) and dialect == "openai"
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        self.url = base
        self.api_key = api_key
        self.dialect = dialect
        self.dialects = (dialect,)
        self.timeout_s = float(timeout_s)
        self.model = model
        self.name = name or f"upstream:{base}"
        self.max_response_bytes = max_response_bytes
        self._max_connections = max_connections
        self._connect_timeout = min(connect_timeout_s, self.timeout_s)
        self._anthropic_version = anthropic_version
        self._trust_env = trust_env
        self._client: aiohttp.ClientSession | None = None
        self._urls = {path: URL(self.url + path) for path in ROUTE_PATHS.values()}
        #: per path, the proxy and netrc options the environment gives its URL (see :func:`_env_options`)
        self._env_options: dict[str, dict] = {path: {} for path in self._urls}
        self._auth = self._auth_headers()

    def _auth_headers(self) -> dict[str, str]:
        h = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
        if self.dialect == "openai":
            if self.api_key:
                h["authorization"] = f"Bearer {self.api_key}"
        else:
            h["anthropic-version"] = self._anthropic_version
            if self.api_key:
                h["x-api-key"] = self.api_key
        return h

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._client is not None:
            return
        connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=30.0,
                                         enable_cleanup_closed=False, ttl_dns_cache=300)
        # connect bounds the wait for a pool slot plus the dial, sock_connect the dial alone, sock_read each read;
        # a whole non-streamed call is bounded by asyncio.timeout in complete().
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_connect=self._connect_timeout,
                                        sock_read=self.timeout_s)
        if self._trust_env:
            self._env_options = await asyncio.to_thread(
                lambda: {path: _env_options(url) for path, url in self._urls.items()})
        # trust_env=False: the environment was read above, once. aiohttp's own trust_env reads the proxy variables
        # and ~/.netrc again on every request, in two thread-pool hops that cost each call a thread wake-up.
        self._client = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                             auto_decompress=True, raise_for_status=False,
                                             cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def model_ids(self) -> list[str]:
        return [self.model] if self.model else []

    # ---- requests ----------------------------------------------------------------------------------------
    def _prepare(self, req: EngineRequest, stream: bool | None) -> tuple[str, bytes, dict[str, str]]:
        self.check_dialect(req)
        path = ROUTE_PATHS.get(req.route)
        if path is None:
            raise ValidationFailed(f"unknown route {req.route!r}")
        body = req.body
        if self.model or (stream is not None and bool(body.get("stream")) != stream):
            body = dict(body)
            if self.model:
                body["model"] = self.model
            if stream is not None:
                body["stream"] = stream
        headers = {k: v for k, v in req.headers.items()
                   if k.lower() not in _DROP_REQUEST and not k.lower().startswith(HEADER_PREFIX)}
        headers.update(self._auth)
        return path, json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(), headers

    def _client_or_fail(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise UpstreamError(f"engine {self.name} is not started")
        return self._client

    async def _post(self, client: aiohttp.ClientSession, path: str, content: bytes,
                    headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send the request; a failed dial (nothing sent yet) is retried once, a sent request never."""
        url, env = self._urls[path], self._env_options[path]
        if env:
            env = dict(env)
            netrc = env.pop("authorization", None)
            if netrc is not None and "authorization" not in headers:  # a provider key wins over netrc
                headers["Authorization"] = netrc
        try:
            return await client.post(url, data=content, headers=headers, allow_redirects=False, **env)
        except _CONNECT_ERRORS:
            return await client.post(url, data=content, headers=headers, allow_redirects=False, **env)

    async def _read_limited(self, resp: aiohttp.ClientResponse) -> bytes:
        declared = resp.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_response_bytes:
            raise UpstreamError(f"provider response too large ({declared} bytes)")
        parts, size = [], 0
        async for chunk in resp.content.iter_any():
            size += len(chunk)
            if size > self.max_response_bytes:
                raise UpstreamError(f"provider response larger than {self.max_response_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def _to_response(self, resp: aiohttp.ClientResponse, raw: bytes, req: EngineRequest) -> EngineResponse:
        status = resp.status
        if status == 503:
            raise UpstreamUnavailable(f"provider answered 503: {_message(raw)}", status=status,
                                      retry_after=_retry_after(resp.headers.get("retry-after")))
        if status >= 500:
            raise UpstreamError(f"provider answered {status}: {_message(raw)}", status=status)
        if 200 <= status < 300:
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise UpstreamError("provider answered invalid JSON") from exc
            if not isinstance(body, dict):
                raise UpstreamError("provider answered JSON that is not an object")
            return EngineResponse(status, body, _filter_response_headers(resp.headers), version=req.version)
        if 400 <= status < 500:
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError
            except ValueError:
                body = error_body(self.dialect, status, raw.decode("utf-8", "replace")[:2000])
            return EngineResponse(relay_status(status), body, _filter_response_headers(resp.headers),
                                  version=req.version)
        raise UpstreamError(f"provider answered unexpected status {status}", status=status)

    async def complete(self, req: EngineRequest) -> EngineResponse:
        path, content, headers = self._prepare(req, stream=False if req.route != "count_tokens" else None)
        client = self._client_or_fail()
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self._post(client, path, content, headers)
                try:
                    raw = await self._read_limited(resp)
                finally:
                    resp.release()  # back to the pool when fully read, else the connection is closed
        except TimeoutError as exc:  # aiohttp's timeouts are TimeoutError subclasses too
            raise UpstreamTimeout(f"provider did not answer within {self.timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise self._connection_failed(exc, "provider connection failed") from exc
        return self._to_response(resp, raw, req)

    def _connection_failed(self, exc: Exception, message: str) -> UpstreamError:
        """The error a client sees for a broken provider connection: a stable message (the HTTP client's exception
        text changes with its version and says nothing a client can act on); the detail goes to the log."""
        log.warning("%s: %s (%s: %s)", self.name, message, type(exc).__name__, exc)
        return UpstreamError(message)

    async def count_tokens(self, req: EngineRequest) -> EngineResponse:
        """Anthropic providers count exactly (``/v1/messages/count_tokens``).

        OpenAI-compatible providers have no counting route: ``count_tokens_mode="estimate"`` (default) counts
        here, with the provider's model's tokenizer or tiktoken where one is known, else ``ceil(characters / 4)``
        over the prompt's text (:mod:`reef_core.engines.token_count`; ``x-reef-token-count`` names the way);
        ``"probe"`` asks the provider for a one-token completion and reports its ``usage.prompt_tokens``
        (exact, but a paid provider bills the whole prompt).
        """
        if self.dialect == "anthropic":
            if req.route != "count_tokens":
                req = EngineRequest(req.dialect, "count_tokens", req.body, req.headers, req.version)
            return await self.complete(req)
        self.check_dialect(req)
        if self.count_tokens_mode == "estimate":
            counted = await asyncio.to_thread(self._counter.count, req.body, self.model or req.body.get("model"))
            n, way = counted or (estimate_tokens(req.body), "estimate")
            return EngineResponse(200, {"input_tokens": n}, {TOKEN_COUNT_HEADER: way}, version=req.version)
        body = {k: v for k, v in req.body.items() if k in ("model", "messages", "tools", "tool_choice")}
        body["max_tokens"] = 1
        resp = await self.complete(EngineRequest("openai", "chat", body, req.headers, req.version))
        if resp.status != 200:
            return resp
        usage = resp.body.get("usage") or {}
        if not isinstance(usage.get("prompt_tokens"), int):
            raise UpstreamError("provider answer carries no usage.prompt_tokens to count with")
        return EngineResponse(200, {"input_tokens": usage["prompt_tokens"]}, {TOKEN_COUNT_HEADER: "probe"},
                              version=req.version)

    async def stream(self, req: EngineRequest) -> AsyncIterator[StreamEvent]:
        path, content, headers = self._prepare(req, stream=True)
        client = self._client_or_fail()
        anthropic = self.dialect == "anthropic"
        relaying = False
        try:
            async with await self._post(client, path, content, headers) as resp:
                ctype = resp.headers.get("content-type", "")
                if resp.status >= 300 or not ctype.startswith("text/event-stream"):
                    raw = await self._read_limited(resp)
                    raise DirectResponse(self._to_response(resp, raw, req))
                yield StreamEvent(HEADERS_EVENT, _filter_response_headers(resp.headers))
                relaying = True
                decoder = SSEDecoder()
                async for chunk in resp.content.iter_any():
                    for name, data in decoder.feed(chunk):
                        if len(data) > self.max_response_bytes:
                            raise UpstreamError("provider stream event too large")
                        try:
                            ev = parse_data(name, data)
                        except ValueError as exc:
                            raise UpstreamError("provider stream carried invalid JSON") from exc
                        if anthropic:
                            if name == "error" or (isinstance(ev.data, dict) and ev.data.get("type") == "error"):
                                raise UpstreamError(f"provider stream error: {error_message(ev.data)}")
                            yield ev
                            if name == "message_stop" or (isinstance(ev.data, dict)
                                                          and ev.data.get("type") == "message_stop"):
                                return
                        else:
                            if isinstance(ev.data, dict) and "error" in ev.data and not ev.data.get("choices"):
                                raise UpstreamError(f"provider stream error: {error_message(ev.data)}")
                            yield ev
                            if ev.data == "[DONE]" or (req.route == "responses" and isinstance(ev.data, dict)
                                                       and ev.data.get("type") in RESPONSES_TERMINAL):
                                return
                    if decoder.buffered > self.max_response_bytes:
                        raise UpstreamError("provider stream event too large")
                raise UpstreamError("stream ended early")
        except TimeoutError as exc:
            raise UpstreamTimeout(f"provider stream stalled for {self.timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise self._connection_failed(exc, "the provider connection broke off mid-stream" if relaying
                                          else "provider connection failed") from exc


#: The events that end a Responses stream (it has no ``[DONE]``).
RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def estimate_tokens(body: dict) -> int:
    """Rough prompt size of a chat body: one token per four characters of its text (and tool JSON)."""
    chars = 0
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        chars += len(content_text(content, non_text="skip"))  # an estimate: non-text parts are not counted
        chars += len(json.dumps(m.get("tool_calls"))) if isinstance(m, dict) and m.get("tool_calls") else 0
        chars += 4 * 4  # role markers and separators: about four tokens per message
    if body.get("tools"):
        chars += len(json.dumps(body["tools"]))
    return max(1, -(-chars // 4))


def _retry_after(value: str | None) -> str | None:
    """A provider's ``Retry-After`` fit to relay (delay-seconds or an HTTP date), else None."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit() and len(value) <= 10:
        return value
    try:
        return value if parsedate_to_datetime(value) is not None else None
    except (TypeError, ValueError, IndexError):
        return None


def _message(raw: bytes) -> str:
    try:
        return error_message(json.loads(raw))[:500]
    except ValueError:
        return raw.decode("utf-8", "replace")[:500]
