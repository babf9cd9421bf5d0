"""FakeUpstream: a protocol-faithful FAKE model provider, for CPU tests and benchmarks only.

It speaks OpenAI Chat Completions (``POST /v1/chat/completions``), OpenAI Responses (``POST /v1/responses``: text
and message input, function tools; the same reply as a response object or the typed event sequence) and Anthropic
Messages (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), non-streamed and streamed (SSE), with the
exact body and event shapes of those APIs, and answers deterministically: the reply is ``"echo: "`` plus
the text of the last user message, split into word pieces for streaming. "Tokens" are whitespace
separated words. ``max_tokens`` truncates the reply (``length`` / ``max_tokens``), stop sequences cut
it (``stop`` / ``stop_sequence``), and a request whose ``tool_choice`` forces a tool (OpenAI
``required`` or a named function; Anthropic ``any`` or ``tool``) is answered with a call of that tool
(arguments ``{"text": <last user text>}``).

Faults are injected at run time through control routes:

* ``POST /_fake/faults`` with one spec or ``{"faults": [spec, ...]}``; each spec applies to the next
  ``fail_next`` (alias ``times``; default 1) inference requests (optionally only those of ``route``:
  ``chat`` | ``messages`` | ``count_tokens``). Spec keys, combinable:
  ``status`` (answer this error status with a dialect-shaped body, or ``body`` if given),
  ``retry_after`` (``retry-after`` header), ``delay_s`` (wait before answering), ``chunk_delay_s``
  (wait between SSE events), ``reset`` (abort the connection before answering),
  ``reset_after_events`` (abort the connection after k SSE events), ``truncate_after`` (end the SSE
  stream cleanly after k events, without its terminal event), ``invalid_json`` (malformed JSON body, or a
  malformed SSE data line after the first event), ``oversized_bytes`` (pad the body, or one SSE event,
  with that many bytes), ``stream_error`` (Anthropic ``error`` event / OpenAI error chunk mid-stream),
  ``not_sse`` (answer a streaming request with a JSON body).
* ``DELETE /_fake/faults`` clears pending faults; ``POST /_fake/reset`` clears faults, stats and log.
* ``GET /_fake/stats`` -> ``{"requests", "routes", "faults_applied", "pending_faults", "in_flight",
  "max_in_flight", "connections"}`` (``connections``: distinct client sockets seen, to check keep-alive);
  ``GET /_fake/requests`` -> the last 100 inference requests (route, headers, body).

Run it with :func:`serve_fake_upstream` (context manager: a background thread or a subprocess on a free
loopback port, yields the base URL), :func:`run_fake_upstream` (blocking), or
``python -m reef_core.testing.fake_upstream --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Iterator

from reef_core.content import content_text
from reef_core.background import bound_socket, serve_asgi, uvicorn_server
from reef_core.testing.asgi import fake_in_process, read_request

__all__ = ["FakeUpstream", "serve_fake_upstream", "run_fake_upstream", "serve_asgi", "FakeUpstreamControl"]

_WORD = re.compile(r"\S+\s*|\s+")
_ROUTES = {"/v1/chat/completions": "chat", "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens",
           "/v1/responses": "responses"}
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                     529: "overloaded_error"}


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def _count(text: str) -> int:
    return len(text.split())


def _text(content: Any) -> str:
    # The fake echoes words: tool results count as words too, images and other parts do not.
    return content_text(content, separator=" ", tool_results=True)


class _Abort(Exception):
    """Abort the connection (fault injection)."""


class FakeUpstream:
    """The raw ASGI app. One instance keeps its faults and counters; it is safe to share across threads."""

    def __init__(self, api_key: str | None = None, model: str = "fake-model"):
        self.api_key = api_key
        self.model = model
        self._lock = threading.Lock()
        self._faults: list[dict] = []
        self.reset()

    # ---- state -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self._faults.clear()
            self._requests = 0
            self._routes: dict[str, int] = {}
            self._faults_applied = 0
            self._in_flight = 0
            self._max_in_flight = 0
            self._log: deque[dict] = deque(maxlen=100)
            self._ids = 0
            self._clients: set = set()

    def add_faults(self, *specs: dict) -> None:
        with self._lock:
            for spec in specs:
                spec = dict(spec)
                spec["_left"] = int(spec.get("fail_next", spec.get("times", 1)))
                self._faults.append(spec)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def stats(self) -> dict:
        with self._lock:
            return {"requests": self._requests, "routes": dict(self._routes), "faults_applied": self._faults_applied,
                    "pending_faults": sum(f["_left"] for f in self._faults), "in_flight": self._in_flight,
                    "max_in_flight": self._max_in_flight, "connections": len(self._clients)}

    def requests_log(self) -> list[dict]:
        with self._lock:
            return list(self._log)

    def _take_fault(self, route: str) -> dict:
        with self._lock:
            for spec in self._faults:
                if spec["_left"] > 0 and spec.get("route") in (None, route):
                    spec["_left"] -= 1
                    self._faults_applied += 1
                    if spec["_left"] == 0:
                        self._faults.remove(spec)
                    return spec
        return {}

    def _next_id(self) -> int:
        with self._lock:
            self._ids += 1
            return self._ids

    # ---- ASGI --------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        raw = await read_request(scope, receive, send)
        if raw is None:
            return
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if path.startswith("/_fake/") or path in ("/healthz", "/v1/models"):
            await self._control(path, method, bytes(raw), send)
            return
        route = _ROUTES.get(path)
        if route is None or method != "POST":
            await _send_json(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})
            return
        with self._lock:
            self._requests += 1
            self._clients.add(tuple(scope.get("client") or ()))
            self._routes[route] = self._routes.get(route, 0) + 1
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
        try:
            await self._inference(route, headers, bytes(raw), send)
        except _Abort:
            _abort(send)
        finally:
            with self._lock:
                self._in_flight -= 1

    async def _control(self, path: str, method: str, raw: bytes, send) -> None:
        if path == "/healthz":
            await _send_json(send, 200, {"ok": True})
        elif path == "/v1/models":
            await _send_json(send, 200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]})
        elif path == "/_fake/faults" and method == "POST":
            body = json.loads(raw or b"{}")
            specs = body.get("faults", [body]) if isinstance(body, dict) else body
            self.add_faults(*specs)
            await _send_json(send, 200, {"queued": len(specs)})
        elif path == "/_fake/faults" and method == "DELETE":
            self.clear_faults()
            await _send_json(send, 200, {"cleared": True})
        elif path == "/_fake/reset" and method == "POST":
            self.reset()
            await _send_json(send, 200, {"reset": True})
        elif path == "/_fake/stats":
            await _send_json(send, 200, self.stats())
        elif path == "/_fake/requests":
            await _send_json(send, 200, {"requests": self.requests_log()})
        else:
            await _send_json(send, 404, {"error": {"message": f"no control route {method} {path}"}})

    async def _inference(self, route: str, headers: dict, raw: bytes, send) -> None:
        dialect = "openai" if route in ("chat", "responses") else "anthropic"
        fault = self._take_fault(route)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        with self._lock:
            self._log.append({"route": route, "headers": headers, "body": body})
        if fault.get("delay_s"):
            await asyncio.sleep(float(fault["delay_s"]))
        if fault.get("reset"):
            raise _Abort
        if fault.get("status"):
            status = int(fault["status"])
            extra = []
            if fault.get("retry_after") is not None:
                extra.append((b"retry-after", str(fault["retry_after"]).encode()))
            err = fault.get("body") or _error(dialect, status, f"injected fault {status}")
            await _send_json(send, status, err, extra)
            return
        auth_error = self._check_auth(dialect, headers)
        if auth_error:
            await _send_json(send, 401, _error(dialect, 401, auth_error))
            return
        if route == "responses":
            chat, problem = _responses_as_chat(body)
            if problem:
                await _send_json(send, 400, _error(dialect, 400, problem))
                return
            answer = _response_object(self._answer("openai", chat), body)
            if body.get("stream"):
                await self._stream(dialect, _response_events(answer), fault, send)
            else:
                await _send_json(send, 200, answer)
            return
        problem = _validate(dialect, route, body)
        if problem:
            await _send_json(send, 400, _error(dialect, 400, problem))
            return
        if route == "count_tokens":
            await _send_json(send, 200, {"input_tokens": _prompt_tokens(body)})
            return
        answer = self._answer(dialect, body)
        if body.get("stream") and not fault.get("not_sse"):
            events = _openai_events(answer, body) if dialect == "openai" else _anthropic_events(answer)
            await self._stream(dialect, events, fault, send)
            return
        payload = _openai_body(answer) if dialect == "openai" else _anthropic_body(answer)
        if fault.get("oversized_bytes"):
            payload["padding"] = "x" * int(fault["oversized_bytes"])
        if fault.get("invalid_json"):
            data = json.dumps(payload).encode()[:-7]
            await _send_raw(send, 200, data, b"application/json")
            return
        await _send_json(send, 200, payload)

    def _check_auth(self, dialect: str, headers: dict) -> str | None:
        if not self.api_key:
            return None
        if dialect == "openai":
            if headers.get("authorization") != f"Bearer {self.api_key}":
                return "Incorrect API key provided"
            return None
        # Anthropic takes x-api-key; recent SDKs send a Bearer token instead.
        if headers.get("x-api-key") != self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            return "invalid x-api-key"
        if not headers.get("anthropic-version"):
            return "anthropic-version header is required"
        return None

    def _answer(self, dialect: str, body: dict) -> dict:
        """The deterministic reply, independent of wire shape."""
        last_user = ""
        for m in body["messages"]:
            if m.get("role") == "user":
                last_user = _text(m.get("content"))
        reply = f"echo: {last_user}"
        n = self._next_id()
        ans = {"id": n, "model": body.get("model") or self.model, "prompt_tokens": _prompt_tokens(body),
               "text": reply, "finish": "stop", "stop_sequence": None, "tool": None}
        tool = _forced_tool(dialect, body)
        if tool:
            ans.update(text="", finish="tool_calls", tool={"name": tool, "arguments": json.dumps({"text": last_user})})
            ans["completion_tokens"] = _count(ans["tool"]["arguments"])
            return ans
        stops = body.get("stop") if dialect == "openai" else body.get("stop_sequences")
        if isinstance(stops, str):
            stops = [stops]
        cut = None
        for s in stops or []:
            i = reply.find(s)
            if i >= 0 and (cut is None or i < cut[0]):
                cut = (i, s)
        if cut:
            reply = reply[: cut[0]]
            ans.update(finish="stop", stop_sequence=cut[1])
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        pieces = _words(reply)
        if limit is not None and len([p for p in pieces if p.strip()]) > int(limit):
            kept, words = [], 0
            for p in pieces:
                if p.strip():
                    if words == int(limit):
                        break
                    words += 1
                kept.append(p)
            reply = "".join(kept)
            ans.update(finish="length", stop_sequence=None)
        ans["text"] = reply
        ans["completion_tokens"] = _count(reply)
        return ans

    async def _stream(self, dialect: str, events: list[tuple[str | None, Any]], fault: dict, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        if fault.get("stream_error"):
            err = ("error", _error("anthropic", 529, "Overloaded")) if dialect == "anthropic" else \
                (None, _error("openai", 500, "stream failed"))
            events = events[:2] + [err]
        truncate = fault.get("truncate_after")
        reset_after = fault.get("reset_after_events")
        delay = float(fault.get("chunk_delay_s") or 0)
        for i, (name, data) in enumerate(events):
            if truncate is not None and i >= int(truncate):
                break
            if reset_after is not None and i >= int(reset_after):
                raise _Abort
            if delay and i:
                await asyncio.sleep(delay)
            if isinstance(data, dict) and fault.get("oversized_bytes") and i == 1:
                data = dict(data, padding="x" * int(fault["oversized_bytes"]))
            text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            frame = (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
            await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
            if fault.get("invalid_json") and i == 0:
                await send({"type": "http.response.body", "body": b'data: {"broken": \n\n', "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# ---- wire shapes -----------------------------------------------------------------------------------------

def _error(dialect: str, status: int, message: str) -> dict:
    if dialect == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": None, "code": None}}


def _validate(dialect: str, route: str, body: Any) -> str | None:
    if not isinstance(body, dict):
        return "request body is not valid JSON"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: field required"
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "messages: a non-empty list is required"
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        allowed = ("system", "developer", "user", "assistant", "tool") if dialect == "openai" else ("user", "assistant")
        if role not in allowed:
            return f"messages.{i}.role: unexpected role {role!r}"
    if dialect == "anthropic" and route == "messages":
        if not isinstance(body.get("max_tokens"), int):
            return "max_tokens: field required"
        t = body.get("temperature")
        if t is not None and not 0 <= t <= 1:
            return "temperature: must be between 0 and 1"
    return None


def _prompt_tokens(body: dict) -> int:
    n = 0
    sys_ = body.get("system")
    n += _count(_text(sys_)) if sys_ else 0
    for m in body.get("messages") or []:
        n += _count(_text(m.get("content")))
    return n


def _responses_as_chat(body: Any) -> tuple[dict, str | None]:
    """The chat body a Responses request stands for, as far as the fake's reply needs it; or a 400's message."""
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        return {}, "model: field required"
    items = body.get("input")
    if isinstance(items, str):
        messages = [{"role": "user", "content": items}]
    elif isinstance(items, list):
        messages = [{"role": i.get("role", "user"), "content": i.get("content")} for i in items
                    if isinstance(i, dict) and i.get("type", "message") == "message"]
    else:
        return {}, "input: field required"
    choice = body.get("tool_choice")
    return {"model": body["model"], "messages": messages or [{"role": "user", "content": ""}],
            "max_tokens": body.get("max_output_tokens"),
            "tools": [{"type": "function", "function": {"name": t.get("name")}} for t in body.get("tools") or []],
            "tool_choice": {"function": {"name": choice.get("name")}} if isinstance(choice, dict) else choice}, None


def _response_object(a: dict, body: dict) -> dict:
    rid = f"resp_fake{a['id']}"
    if a["tool"]:
        output = [{"type": "function_call", "id": f"fc_fake{a['id']}", "call_id": f"call_fake{a['id']}",
                   "name": a["tool"]["name"], "arguments": a["tool"]["arguments"], "status": "completed"}]
    else:
        output = [{"type": "message", "id": f"msg_fake{a['id']}", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": a["text"], "annotations": [], "logprobs": []}]}]
    incomplete = a["finish"] == "length"
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": a["model"],
            "status": "incomplete" if incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "output": output, "parallel_tool_calls": True, "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True), "temperature": 1.0, "top_p": 1.0,
            "tool_choice": body.get("tool_choice", "auto"), "tools": [
                {"type": "function", "name": t.get("name"), "parameters": t.get("parameters") or {},
                 "strict": False} for t in body.get("tools") or []],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
            "usage": {"input_tokens": a["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": a["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": a["prompt_tokens"] + a["completion_tokens"]}}


def _response_events(response: dict) -> list[tuple[str | None, Any]]:
    """The typed event sequence of ``response``: text in word pieces, a call's arguments in one delta."""
    events: list[tuple[str | None, Any]] = []

    def add(kind: str, **fields) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    shell = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    add("response.created", response=shell)
    add("response.in_progress", response=shell)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            add("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                          "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            add("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)
            for piece in _words(text):
                add("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                    delta=piece, logprobs=[])
            add("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                logprobs=[])
            add("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                part={**part, "text": text})
        else:
            add("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                          "arguments": ""})
            add("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                delta=item["arguments"])
            add("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                arguments=item["arguments"], name=item["name"])
        add("response.output_item.done", output_index=index, item=item)
    add("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return events


def _forced_tool(dialect: str, body: dict) -> str | None:
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if not tools or not choice:
        return None
    if dialect == "openai":
        first = (tools[0].get("function") or {}).get("name")
        if choice == "required":
            return first
        if isinstance(choice, dict):
            return (choice.get("function") or {}).get("name")
        return None
    if choice.get("type") == "any":
        return tools[0].get("name")
    if choice.get("type") == "tool":
        return choice.get("name")
    return None


def _usage_openai(a: dict) -> dict:
    return {"prompt_tokens": a["prompt_tokens"], "completion_tokens": a["completion_tokens"],
            "total_tokens": a["prompt_tokens"] + a["completion_tokens"]}


def _openai_body(a: dict) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": a["text"] if not a["tool"] else None, "refusal": None,
                           "annotations": []}
    if a["tool"]:
        msg["tool_calls"] = [{"id": f"call_fake{a['id']}", "type": "function", "function": a["tool"]}]
    return {"id": f"chatcmpl-fake{a['id']}", "object": "chat.completion", "created": int(time.time()),
            "model": a["model"], "system_fingerprint": "fp_fake",
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": a["finish"]}],
            "usage": _usage_openai(a)}


def _openai_events(a: dict, body: dict) -> list[tuple[str | None, Any]]:
    base = {"id": f"chatcmpl-fake{a['id']}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": a["model"], "system_fingerprint": "fp_fake"}

    def chunk(delta: dict, finish: str | None = None) -> tuple[None, dict]:
        return None, dict(base, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])

    out = [chunk({"role": "assistant", "content": "", "refusal": None})]
    if a["tool"]:
        args = a["tool"]["arguments"]
        half = len(args) // 2
        out.append(chunk({"tool_calls": [{"index": 0, "id": f"call_fake{a['id']}", "type": "function",
                                          "function": {"name": a["tool"]["name"], "arguments": ""}}]}))
        for frag in (args[:half], args[half:]):
            out.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": frag}}]}))
    else:
        out += [chunk({"content": w}) for w in _words(a["text"])]
    out.append(chunk({}, a["finish"]))
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append((None, dict(base, choices=[], usage=_usage_openai(a))))
    out.append((None, "[DONE]"))
    return out


_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _anthropic_stop(a: dict) -> str:
    return "stop_sequence" if a["stop_sequence"] else _STOP[a["finish"]]


def _anthropic_body(a: dict) -> dict:
    if a["tool"]:
        content = [{"type": "tool_use", "id": f"toolu_fake{a['id']}", "name": a["tool"]["name"],
                    "input": json.loads(a["tool"]["arguments"])}]
    else:
        content = [{"type": "text", "text": a["text"], "citations": None}]
    return {"id": f"msg_fake{a['id']}", "type": "message", "role": "assistant", "model": a["model"],
            "content": content, "stop_reason": _anthropic_stop(a), "stop_sequence": a["stop_sequence"],
            "usage": _usage_anthropic(a["prompt_tokens"], a["completion_tokens"])}


def _usage_anthropic(input_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage object with every member its API sends (the nullable ones null)."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "cache_creation": {"ephemeral_1h_input_tokens": 0,
                                                             "ephemeral_5m_input_tokens": 0},
            "server_tool_use": None, "service_tier": "standard"}


def _anthropic_events(a: dict) -> list[tuple[str | None, Any]]:
    msg = {"id": f"msg_fake{a['id']}", "type": "message", "role": "assistant", "model": a["model"], "content": [],
           "stop_reason": None, "stop_sequence": None,
           "usage": _usage_anthropic(a["prompt_tokens"], 1)}
    out: list[tuple[str | None, Any]] = [("message_start", {"type": "message_start", "message": msg})]
    if a["tool"]:
        block = {"type": "tool_use", "id": f"toolu_fake{a['id']}", "name": a["tool"]["name"], "input": {}}
        args = a["tool"]["arguments"]
        half = len(args) // 2
        deltas = [{"type": "input_json_delta", "partial_json": f} for f in (args[:half], args[half:])]
    else:
        block = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": w} for w in _words(a["text"])]
    out.append(("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}))
    out.append(("ping", {"type": "ping"}))
    out += [("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": d}) for d in deltas]
    out.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    out.append(("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": _anthropic_stop(a), "stop_sequence": a["stop_sequence"]},
                                  "usage": {"output_tokens": a["completion_tokens"]}}))
    out.append(("message_stop", {"type": "message_stop"}))
    return out


# ---- ASGI helpers ------------------------------------------------------------------------------------------

async def _send_raw(send, status: int, body: bytes, ctype: bytes, extra: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send, status: int, obj: Any, extra: list | None = None) -> None:
    await _send_raw(send, status, json.dumps(obj).encode(), b"application/json", extra)


def _abort(send) -> None:
    """Reset the TCP connection under uvicorn (its ``send`` is a bound method of the request cycle)."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise RuntimeError("connection reset needs uvicorn")
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # SO_LINGER 0: close with RST, not FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    transport.abort()


# ---- running it -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def serve_fake_upstream(api_key: str | None = None, *, mode: str = "thread",
                        app: FakeUpstream | None = None) -> Iterator[str]:
    """Start a FakeUpstream on a free loopback port and yield its base URL (e.g. ``http://127.0.0.1:41234``).

    ``mode="thread"`` serves it in this process (cheap; its ``app`` object can be inspected directly);
    ``mode="process"`` runs ``python -m reef_core.testing.fake_upstream`` in a subprocess so that it does
    not share this interpreter's GIL (benchmarks).
    """
    if mode == "thread":
        with serve_asgi(app or FakeUpstream(api_key=api_key)) as url:
            yield url
        return
    if mode != "process":
        raise ValueError("mode must be 'thread' or 'process'")
    cmd = [sys.executable, "-m", "reef_core.testing.fake_upstream", "--port", "0"]
    if api_key:
        cmd += ["--api-key", api_key]
    with fake_in_process(cmd, "FAKE_UPSTREAM", "fake upstream") as url:
        yield url


def run_fake_upstream(port: int = 0, host: str = "127.0.0.1", api_key: str | None = None) -> None:
    """Serve a FakeUpstream in the foreground (blocking); prints ``FAKE_UPSTREAM <url>`` once listening."""
    sock = bound_socket(host, port)
    print(f"FAKE_UPSTREAM http://{host}:{sock.getsockname()[1]}", flush=True)
    uvicorn_server(FakeUpstream(api_key=api_key)).run(sockets=[sock])


class FakeUpstreamControl:
    """Tiny synchronous client of the control routes (for tests driving a fake in another process)."""

    def __init__(self, url: str):
        import httpx

        self._http = httpx.Client(base_url=url, timeout=10)

    def faults(self, *specs: dict) -> None:
        self._http.post("/_fake/faults", json={"faults": list(specs)}).raise_for_status()

    def clear(self) -> None:
        self._http.delete("/_fake/faults").raise_for_status()

    def reset(self) -> None:
        self._http.post("/_fake/reset").raise_for_status()

    def stats(self) -> dict:
        return self._http.get("/_fake/stats").json()

    def requests(self) -> list[dict]:
        return self._http.get("/_fake/requests").json()["requests"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="FakeUpstream: a fake OpenAI/Anthropic provider for tests")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", default=None, help="require this key (Bearer / x-api-key)")
    args = parser.parse_args(argv)
    run_fake_upstream(args.port, args.host, args.api_key)


if __name__ == "__main__":
    main()
