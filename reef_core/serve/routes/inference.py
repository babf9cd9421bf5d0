"""Inference routes: call the engine, store the record durably, then hand out the receipt.

Order per request: parse and validate the whole request (body, scenario name, tags, ids) → resolve
the scenario without creating it (a new name gets a provisional binding to its recipe) → freeze the
serving version → call the engine (translating dialects when the engine speaks the other one) →
append the record and wait until it is durable (the first record of a new scenario creates it, in
the same transaction) → reply with ``x-reef-agent-record-id``. A refused request, and a relayed
provider error, store nothing and create nothing (except that a recipe serving a seed release
creates its scenario once the request has passed the door: see ``Deployment.serves_a_seed``).

Streams relay events as they arrive and hold the terminal event: the record is stored first,
then the receipt goes out in-band (an extra OpenAI chunk before ``[DONE]``; a ``reef`` field on
Anthropic's ``message_stop``). A stream carries no receipt header, because headers leave before
the record exists. A stream cut short is stored as incomplete (never trainable) and the client
gets a clean error event.

A client that leaves before its answer is delivered (mid-stream, before the first event, or while
a plain answer is computed) stops the engine work; what was generated is stored as incomplete with
``payload.error = "client_disconnected"``. Storing is never undone by a cancellation.

A retry (same ``x-reef-agent-record-id``, same ``Idempotency-Key``, or an SDK retry of the same
body) replays a complete record only; a retry of an incomplete one runs again, and its record names
the attempt it retries in ``payload.retry_of``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from reef_core.engines.base import TOKENS_EVENT, DirectResponse, EngineResponse, StreamEvent, TokenData
from reef_core.engines.translate import stream_translator, translate_error, translate_response
from reef_core.errors import PayloadTooLarge, ReefError, ValidationFailed
from reef_core.loop.inference import Exchange, Retry, new_record_id
from reef_core.observe.model import Record, canonical_bytes
from reef_core.engines.sse import encode_event
from reef_core.names import header_text
from reef_core.serve.routes.aggregate import accumulator_for, receipt_events, synthetic_stream
from reef_core.serve.routes.compacted import refuse_compacted
from reef_core.serve.routes.disconnect import CLIENT_DISCONNECTED, ClientGone, ClientWatch
from reef_core.serve.errors import error_body, new_error_id
from reef_core.serve.routes.jsonbody import parse_json_object
from reef_core.serve.routes import responses
from reef_core.serve.routes.names import RECORD_ID_HEADER, optional_id_header, pin_header, scenario_header
from reef_core.serve.schema import validate_request
from reef_core.serve.middleware.tenancy import principal_of
from reef_core.wire import (HEADER_PREFIX, IDEMPOTENCY_HEADER, OVERHEAD_HEADER, REPLAYED_HEADER, TAG_PREFIX,
                            TOKEN_COUNT_HEADER)

log = logging.getLogger("reef.serve")

#: Request headers never forwarded to an engine: credentials, Reef's own, and hop-by-hop ones.
_DROP_HEADERS = frozenset({"authorization", "x-api-key", "host", "content-length", "content-type", "connection",
                           "accept-encoding", "cookie", "transfer-encoding", "idempotency-key"})
_MAX_TAGS = 32
_MAX_TAG_LENGTH = 512


async def read_body(request: Request, limit: int) -> bytearray:
    """The raw body in one buffer, read incrementally: refused (413) on a Content-Length over ``limit`` before
    reading anything, and as soon as the bytes read exceed it (the answer closes the connection)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    buffer = bytearray()
    try:
        async for chunk in request.stream():
            if len(buffer) + len(chunk) > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            buffer += chunk
    except ClientDisconnect:  # the client left, or the server's body timeout closed the connection
        raise ValidationFailed("the request body ended early: the client disconnected") from None
    return buffer


async def read_json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object (:func:`read_body`, then :func:`parse_json_object`)."""
    return parse_json_object(await read_body(request, limit))


async def admin_fields(request: Request, dep, fields: set[str], takes: str) -> dict:
    """An admin decision's body (an alias move, a canary decision): a JSON object of only ``fields``; an unknown
    field is a 400 naming it and saying what the route ``takes``."""
    body = await read_json_body(request, dep.server.max_admin_body_bytes)
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ValidationFailed(f"{unknown[0]}: unknown field ({takes})", param=unknown[0])
    return body


def tags_of(request: Request) -> dict[str, str]:
    tags = {}
    for key, value in request.headers.items():
        if key.startswith(TAG_PREFIX) and len(key) > len(TAG_PREFIX):
            value = header_text(value, key)
            if len(value) > _MAX_TAG_LENGTH:
                raise ValidationFailed(f"header {key} is longer than {_MAX_TAG_LENGTH} characters", field=key)
            tags[key[len(TAG_PREFIX):].lower()] = value
    if len(tags) > _MAX_TAGS:
        raise ValidationFailed(f"at most {_MAX_TAGS} x-reef-tag-* headers")
    return tags


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items()
            if k not in _DROP_HEADERS and not k.startswith(HEADER_PREFIX) and not k.startswith("x-stainless")}


def _retry_count(request: Request) -> int:
    try:
        return int(request.headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        return 0


class InferenceCall:
    """One inference request through its whole life."""

    def __init__(self, deployment, request: Request, client_dialect: str, route: str):
        self.dep = deployment
        self.request = request
        self.client_dialect = client_dialect
        self.route = route
        self.started = time.perf_counter()
        self.created_at = time.time()

    async def run(self) -> Response:
        dep, request = self.dep, self.request
        body = await read_json_body(request, dep.server.max_body_bytes)
        #: the Responses request (``POST /v1/responses``), which runs as the chat body it stands for
        self.responses: dict | None = body if self.route == "responses" else None
        if self.responses is not None:
            responses.validate_responses(body)
        else:
            validate_request(self.client_dialect, self.route, body)
        name = scenario_header(request)
        self.tags = tags_of(request)
        self.client_record_id = optional_id_header(request, RECORD_ID_HEADER)
        self.idempotency_key = optional_id_header(request, IDEMPOTENCY_HEADER)
        # Rate limits and budgets (429 before any engine work, a stream included); in memory, no database trip.
        self.usage = request.app.state.reef_usage
        self.principal = principal_of(request.scope)
        self.pin = pin_header(request, self.principal)
        self.usage.admit(self.principal, name)
        self.scenario = await dep.resolve(name)  # creates nothing: the first stored record does
        # What /metrics and the request log line learn about this call (never a body or a token).
        self.facts = request.scope.setdefault("state", {})["reef_facts"] = {"scenario": self.scenario.name}
        self.request_hash = hashlib.sha256(canonical_bytes({"route": self.route, "body": body})).hexdigest()
        # An upstream that serves Responses itself gets the request unchanged (a scenario whose surface shapes chat
        # requests is still served through chat); otherwise it runs as the chat request it stands for.
        self.passthrough = (self.responses is not None and getattr(dep.engine, "serves_responses", False)
                            and dep.surface_for(self.scenario) is None)
        if self.passthrough:
            self.client_dialect, self.route = "openai", "responses"
        elif self.responses is not None:
            body = await responses.chat_body(dep.find_record, self.scenario.name, body)
            validate_request("openai", "chat", body)
            self.client_dialect, self.route = "openai", "chat"
        self.client_body = body

        sdk_retry = _retry_count(request) > 0
        if self.client_record_id or self.idempotency_key or sdk_retry:
            retry = await asyncio.to_thread(
                dep.find_retry, self.scenario.name, self.request_hash, self.client_record_id or new_record_id(),
                client_record_id=self.client_record_id, idempotency_key=self.idempotency_key, sdk_retry=sdk_retry)
        else:  # names no earlier attempt: nothing to look up, so no worker-thread hop (a scheduler wake-up each way)
            retry = Retry(record_id=new_record_id())
        if retry.replay is not None:
            return self._replay(retry.replay, stream=bool(body.get("stream")))
        self.record_id = retry.record_id
        plan = await dep.plan_inference(self.scenario, self.client_dialect, self.route, body, _forward_headers(request),
                                        pin=self.pin, tags=self.tags, record_id=self.record_id)
        self.scenario, self.engine_dialect, self.engine_request = plan.scenario, plan.engine_dialect, plan.engine_request
        self.extra_headers = plan.response_headers
        self.exchange = Exchange(
            record_id=self.record_id, scenario=self.scenario.name, client_dialect=self.client_dialect, plan=plan,
            engine_name=dep.engine.name, tags=self.tags, request_hash=self.request_hash, created_at=self.created_at,
            retry_of=retry.retry_of,
            responses_entry=responses.record_entry(self.responses, self.record_id) if self.responses is not None
            else None)
        # From here on the client may leave; the watch notices (and owns the receive channel).
        self.watch = ClientWatch(request.receive)
        try:
            response = await (self._stream() if body.get("stream") else self._complete())
        except BaseException:
            self.watch.close()
            raise
        if not isinstance(response, _RecordedStream):  # a live stream keeps watching until it ends
            self.watch.close()
        return response

    # -- replies -------------------------------------------------------------------------------

    def _replay(self, record: Record, stream: bool) -> Response:
        refuse_compacted(record)  # 410: a retry of an exchange whose reply retention dropped is not run again
        payload = record.payload
        self.facts["receipt"] = record.record_id
        # A token count is answered as the engine gave it (see _complete); only chat answers are translated.
        body = payload["response"] if self.route == "count_tokens" else translate_response(
            payload["response"], payload["dialect"], self.client_dialect)
        headers = {RECORD_ID_HEADER: record.record_id, REPLAYED_HEADER: "true"}
        if self.passthrough:
            return responses.passthrough_answer(body, record.record_id, stream, headers)
        if self.responses is not None:
            return responses.answer(self.responses, body, record.record_id, record.created_at, headers)
        if stream:
            return StreamingResponse(synthetic_stream(self.client_dialect, body, record.record_id),
                                     media_type="text/event-stream", headers={REPLAYED_HEADER: "true"})
        return JSONResponse(body, headers=headers)

    # -- non-streaming ---------------------------------------------------------------------------

    async def _complete(self) -> Response:
        engine = self.dep.engine
        req = self.engine_request
        started = time.perf_counter()
        try:
            result = await self.watch.run(
                engine.count_tokens(req) if self.route == "count_tokens" else engine.complete(req))
        except ClientGone:
            # The engine's work was stopped; the record says the request came and was abandoned.
            record = self._record(response=None, tokens=None, version=None,
                                  engine_ms=(time.perf_counter() - started) * 1000, complete=False,
                                  error=CLIENT_DISCONNECTED)
            await self.dep.record_stored(record, self.idempotency_key)
            return _gone_response(self.client_dialect)
        engine_ms = (time.perf_counter() - started) * 1000
        if result.status >= 400:
            return self._relay_error(result)
        # A client that left while the answer came back never sees its receipt: the record must not train.
        gone = self.watch.gone
        record = self._record(response=result.body, tokens=result.tokens, version=result.version,
                              engine_ms=engine_ms, complete=not gone, error=CLIENT_DISCONNECTED if gone else None)
        stored = await self.dep.record_stored(record, self.idempotency_key)
        if gone:
            return _gone_response(self.client_dialect)
        body = result.body if self.route == "count_tokens" else translate_response(
            result.body, self.engine_dialect, self.client_dialect)
        overhead = (time.perf_counter() - self.started) * 1000 - engine_ms
        headers = {RECORD_ID_HEADER: stored.record_id, **self.extra_headers, OVERHEAD_HEADER: f"{overhead:.2f}"}
        if self.route == "count_tokens" and TOKEN_COUNT_HEADER in result.headers:  # how the engine counted
            headers[TOKEN_COUNT_HEADER] = result.headers[TOKEN_COUNT_HEADER]
        if self.responses is not None and not self.passthrough:
            return responses.answer(self.responses, body, stored.record_id, self.created_at, headers)
        return JSONResponse(body, headers=headers)

    def _relay_error(self, result: EngineResponse) -> Response:
        """A relayed provider error, plain or in place of a stream: the client sees the provider's status,
        message and ``retry-after`` in its own dialect; nothing is recorded."""
        relay_headers = {k: v for k, v in result.headers.items() if k.lower() == "retry-after"}
        return JSONResponse(translate_error(result.body, result.status, self.client_dialect),
                            status_code=result.status, headers=relay_headers)

    def _record(self, *, response: Any, tokens: TokenData | None, version: str | None, engine_ms: float,
                complete: bool, error: str | None = None, stream: bool = False) -> Record:
        """The call's record (:meth:`Exchange.record`); counts its tokens for the request log and the budgets."""
        counted = _usage(response)
        self.facts.update(receipt=self.record_id, engine_ms=round(engine_ms, 3), stream=stream, **counted)
        self.usage.spend(self.principal, self.scenario.name, sum(counted.values()))
        return self.exchange.record(response=response, tokens=tokens, version=version, engine_ms=engine_ms,
                                    total_ms=(time.perf_counter() - self.started) * 1000, complete=complete,
                                    error=error, stream=stream)

    # -- streaming -------------------------------------------------------------------------------

    async def _stream(self) -> Response:
        engine = self.dep.engine
        events = engine.stream(self.engine_request)
        # What the stream has carried so far: whoever ends it (the relay, a client gone, a failure) stores it.
        self.accumulator = responses.ResponsesAccumulator() if self.passthrough else accumulator_for(
            self.engine_dialect)
        self.tokens: TokenData | None = None
        self.stream_started = time.perf_counter()
        self.stream_stored = False
        try:
            first = await self.watch.run(_first_event(events))
        except ClientGone:
            await self._store_stream(CLIENT_DISCONNECTED)
            return _gone_response(self.client_dialect)
        except DirectResponse as direct:
            result: EngineResponse = direct.response
            if result.status >= 400:
                return self._relay_error(result)
            # The provider answered without a stream: relay it as one.
            gone = self.watch.gone
            record = self._record(response=result.body, tokens=result.tokens, version=result.version,
                                  engine_ms=0.0, complete=not gone, error=CLIENT_DISCONNECTED if gone else None,
                                  stream=True)
            stored = await self.dep.record_stored(record, self.idempotency_key)
            body = translate_response(result.body, self.engine_dialect, self.client_dialect)
            if self.passthrough:
                return responses.passthrough_answer(body, stored.record_id, True, {})
            if self.responses is not None:
                return responses.answer(self.responses, body, stored.record_id, self.created_at, {})
            return StreamingResponse(synthetic_stream(self.client_dialect, body, stored.record_id),
                                     media_type="text/event-stream")
        # Errors before the first event propagate as ordinary error responses.
        return _RecordedStream(self, first, events, headers={"cache-control": "no-store", "x-accel-buffering": "no",
                                                             **self.extra_headers})

    async def _relay(self, first: StreamEvent | None, events: AsyncIterator[StreamEvent]):
        """The client's SSE frames; stores the record before the terminal event (receipt or error)."""
        # A Responses stream: the chat chunks become typed events as they arrive.
        live = (responses.LiveStream(self.responses, self.record_id, self.created_at)
                if self.responses is not None and not self.passthrough else None)
        state = _RelayState()
        if live is not None:
            for frame in live.start(self.engine_request.body.get("model")):
                yield frame
        try:
            async for frame in self._frames(first, events, live, state):
                yield frame
            if not state.terminal_seen or not self.accumulator.complete:
                state.error = "stream ended before its terminal event"
        except ReefError as exc:
            state.error = exc.message
        except Exception:  # noqa: BLE001 - headers are out: end the stream with an error event, never drop it
            error_id = new_error_id()
            log.exception("unhandled error %s in a stream of %s", error_id, self.route)
            state.error = f"internal error (id {error_id})"
        # A cancellation (client gone, server stopping) ends the relay here: _RecordedStream stores the record.
        stored = await self._store_stream(state.error)
        for frame in self._ending(state, stored, live):
            yield frame

    async def _frames(self, first: StreamEvent | None, events: AsyncIterator[StreamEvent],
                      live: "responses.LiveStream | None", state: "_RelayState"):
        """The frames of the engine's events as they arrive, the terminal one held back (``state`` says it came)."""
        # The client's own stream_options: a request translated to Anthropic carries none.
        options = self.client_body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        translator = stream_translator(self.engine_dialect, self.client_dialect, include_usage=include_usage,
                                       model=self.engine_request.body.get("model"))

        def client_frames(out: StreamEvent):
            if _is_terminal(self.client_dialect, out):
                state.terminal_seen = True  # held until the record is durable
                return []
            if out.is_reef:
                return []
            return live.feed(out.data) if live is not None else [encode_event(out)]

        async for event in _chain(first, events):
            if event.event == TOKENS_EVENT:
                self.tokens = TokenData.from_dict(event.data)
                continue
            self.accumulator.feed(event)
            if self.passthrough:
                for frame in self._passthrough_frame(event, state):
                    yield frame
                continue
            for out in (translator.feed(event) if translator else [event]):
                for frame in client_frames(out):
                    yield frame
        if translator is not None and not state.terminal_seen:
            for out in translator.finish():
                for frame in client_frames(out):
                    yield frame

    @staticmethod
    def _passthrough_frame(event: StreamEvent, state: "_RelayState") -> list[bytes]:
        """A passed-through Responses event as its frame; its terminal event is held to go with the receipt."""
        if event.is_reef:
            return []
        if responses.is_terminal(event.data):
            state.terminal_seen, state.held = True, event
            return []
        return [responses.frame(event.data)] if isinstance(event.data, dict) else []

    def _ending(self, state: "_RelayState", stored: Record | None, live: "responses.LiveStream | None"):
        """The frames after the record is stored: the held terminal event with the receipt, or an error event."""
        error = state.error
        if self.passthrough:
            if error is not None or stored is None or state.held is None:
                fields = {"type": "error", "code": "upstream_error", "message": error or "the answer was not stored",
                          "param": None}
                if stored is not None:
                    fields["reef"] = {"agent_record_id": stored.record_id, "complete": False}
                return [responses.frame(fields)]
            return [responses.frame({**state.held.data, "reef": {"agent_record_id": stored.record_id}})]
        if live is not None:
            if error is not None or stored is None:
                return list(live.error(error or "the answer could not be stored", stored and stored.record_id))
            completion = translate_response(self.accumulator.body(), self.engine_dialect, "openai")
            return list(live.finish(responses.response_object(self.responses, completion, stored.record_id,
                                                              self.created_at)))
        if error is not None:
            return [encode_event(_error_event(self.client_dialect, error, stored.record_id if stored else None))]
        return [encode_event(out) for out in receipt_events(self.client_dialect, stored.record_id,
                                                            self.engine_request.body.get("model"))]

    async def _store_stream(self, error: str | None) -> Record | None:
        """Store what the stream carried (once per stream), complete when ``error`` is ``None``. The append is
        queued before the first suspension, so a cancellation of the caller cannot withdraw it."""
        if self.stream_stored:
            return None
        self.stream_stored = True
        tokens = self.tokens
        record = self._record(response=self.accumulator.body(), tokens=tokens,
                              version=tokens.version if tokens else None,
                              engine_ms=(time.perf_counter() - self.stream_started) * 1000,
                              complete=error is None, error=error, stream=True)
        try:
            return await self.dep.record_stored(record, self.idempotency_key)
        except Exception:  # noqa: BLE001 - the client still gets a clean error event
            log.exception("could not store stream record %s", record.record_id)
            return None


class _RecordedStream(StreamingResponse):
    """A live stream: relays the engine's events while the call's watch looks out for the client leaving.

    However the stream ends (terminal event, provider cut, client gone, server cancelling the request), its record
    is stored exactly once: by the relay itself, or here with the reason it stopped.
    """

    def __init__(self, call: InferenceCall, first: StreamEvent | None, events: AsyncIterator[StreamEvent],
                 headers: dict[str, str]):
        super().__init__(call._relay(first, events), media_type="text/event-stream", headers=headers)
        self.call = call
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        call = self.call
        try:
            await call.watch.run(self._pump(send))
        except ClientGone:
            await call._store_stream(CLIENT_DISCONNECTED)
        except BaseException as exc:
            await call._store_stream(f"stream interrupted: {type(exc).__name__}")
            raise
        finally:
            call.watch.close()
            await self.body_iterator.aclose()
            await self.events.aclose()  # closes the provider's stream when the relay stopped midway

    async def _pump(self, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for frame in self.body_iterator:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError as exc:  # ASGI servers of spec 2.4+ report a closed connection on send
            raise ClientGone() from exc


@dataclass
class _RelayState:
    """What a relay has seen so far: the terminal event (passed-through Responses streams hold it), an error."""

    terminal_seen: bool = False
    held: StreamEvent | None = None
    error: str | None = None


async def _chain(first: StreamEvent | None, events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    """The stream's first event (already read, to tell a stream from a direct answer), then the rest."""
    if first is not None:
        yield first
    async for event in events:
        yield event


async def _first_event(events: AsyncIterator[StreamEvent]) -> StreamEvent | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


def _gone_response(dialect: str) -> Response:
    """What a request whose client left is answered (nobody reads it; 499 is the usual log code for it)."""
    return JSONResponse(error_body("anthropic" if dialect == "anthropic" else "openai", 499,
                                   "the client closed the connection", CLIENT_DISCONNECTED), status_code=499)


def _is_terminal(dialect: str, event: StreamEvent) -> bool:
    if dialect == "openai":
        return event.data == "[DONE]"
    return event.event == "message_stop" or (isinstance(event.data, dict) and event.data.get("type") == "message_stop")


def _error_event(dialect: str, message: str, record_id: str | None) -> StreamEvent:
    body = error_body("anthropic" if dialect == "anthropic" else "openai", 502, message, "upstream_error")
    if record_id:
        body["reef"] = {"agent_record_id": record_id, "complete": False}
    return StreamEvent("error" if dialect == "anthropic" else None, body)


def _usage(response: Any) -> dict[str, int]:
    """Tokens in and out from a response body's ``usage`` (OpenAI or Anthropic names), when it has one."""
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return {}
    found = {"tokens_in": usage.get("prompt_tokens", usage.get("input_tokens")),
             "tokens_out": usage.get("completion_tokens", usage.get("output_tokens"))}
    return {k: v for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}
