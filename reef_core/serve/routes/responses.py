"""``POST /v1/responses`` (OpenAI Responses API) served through the chat path.

A Responses request is validated at the door, turned into a Chat Completions body (``instructions`` as the system
message, ``input`` items as chat turns, function tools as chat tools, ``max_output_tokens`` as ``max_tokens``) and
then runs exactly as a chat request does: the same engines (translated to Anthropic for an Anthropic upstream),
receipts, scenarios, tags, idempotency and harness/skill injection. The record stores the chat exchange (so a
processor reads it as any served exchange) plus a ``responses`` entry: the response id ``resp_<receipt>``, the
``previous_response_id`` and ``store``.

``previous_response_id`` names an earlier stored response of the same scenario: its conversation (without its
``instructions``, which do not carry over) and its reply come before the new input. A response made with
``store: false`` cannot be chained (404, as OpenAI answers). ``stream: true`` answers the typed event sequence
(``response.created`` ... ``response.completed``, the receipt on the terminal event's ``reef`` field), relayed live
from the engine's chat stream by :class:`LiveStream` (text deltas and function-call arguments as they are generated);
a replayed retry answers the same sequence built from the stored answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.responses import JSONResponse, StreamingResponse

from reef_core.errors import NotFound, ValidationFailed
from reef_core.observe.processors.conversation import UnusableRecord, exchange_of
from reef_core.serve.routes.compacted import refuse_compacted
from reef_core.wire import HEADER_PREFIX

RESPONSE_PREFIX = "resp_"
_ROLES = frozenset({"user", "assistant", "system", "developer"})


def _fail(param: str, problem: str):
    raise ValidationFailed(f"{param}: {problem}", param=param)


def validate_responses(body: dict) -> None:
    """The Responses fields Reef reads, checked before anything runs (400 naming the field)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        _fail("model", "is required (a string)")
    if "input" not in body:
        _fail("input", "is required")
    items = body["input"]
    if not isinstance(items, (str, list)):
        _fail("input", "must be a string or a list of input items")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        _check_item(item, f"input[{i}]")
    for key, kind, name in (("instructions", str, "a string"), ("previous_response_id", str, "a string"),
                            ("store", bool, "a boolean"), ("stream", bool, "a boolean"),
                            ("metadata", dict, "an object"), ("parallel_tool_calls", bool, "a boolean")):
        if body.get(key) is not None and not isinstance(body[key], kind):
            _fail(key, f"must be {name}")
    tokens = body.get("max_output_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        _fail("max_output_tokens", "must be a positive integer")
    for key, lo, hi in (("temperature", 0, 2), ("top_p", 0, 1), ("presence_penalty", -2, 2),
                        ("frequency_penalty", -2, 2)):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not lo <= value <= hi):
            _fail(key, f"must be a number from {lo} to {hi}")
    for key in ("safety_identifier", "prompt_cache_key"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > 64):
            _fail(key, "must be a string of at most 64 characters")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            _fail("tools", "must be a list")
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                _fail(f"tools[{j}].type", "only function tools are served")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                _fail(f"tools[{j}].name", "must be a string")
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
                _fail(f"tools[{j}].parameters", "must be an object")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)):
        _fail("tool_choice", "must be 'auto', 'none', 'required' or {type: function, name}")


def _check_item(item: Any, where: str) -> None:
    if not isinstance(item, dict):
        _fail(where, "must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        if not isinstance(item.get("role"), str) or item["role"] not in _ROLES:  # a list or object is unhashable
            _fail(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}")
        content = item.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "input_image":
                    url = part.get("image_url")
                    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
                        _fail(f"{where}.content[{j}].image_url", "must be a data: or http(s) URL (file_id images "
                              "are not served)")
                    if part.get("detail") is not None and part["detail"] not in ("auto", "low", "high"):
                        _fail(f"{where}.content[{j}].detail", "must be auto, low or high")
                elif not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                        or not isinstance(part.get("text"), str):
                    _fail(f"{where}.content[{j}]", "must be an input_text, output_text or input_image part")
        elif not isinstance(content, str):
            _fail(f"{where}.content", "must be a string or a list of text parts")
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                _fail(f"{where}.{key}", "must be a string")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            _fail(f"{where}.call_id", "must be a string")
        if not isinstance(item.get("output"), str):
            _fail(f"{where}.output", "must be a string")
    else:
        _fail(f"{where}.type", "must be message, function_call or function_call_output")


def _chat_turns(items: str | list) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    turns: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            role = "system" if item["role"] == "developer" else item["role"]
            if isinstance(content, list) and any(part["type"] == "input_image" for part in content):
                # Images stay chat content parts (the engine refuses them if it cannot see them).
                turns.append({"role": role, "content": [
                    {"type": "image_url", "image_url": {"url": part["image_url"],
                                                        **({"detail": part["detail"]} if part.get("detail") else {})}}
                    if part["type"] == "input_image" else {"type": "text", "text": part["text"]}
                    for part in content]})
                continue
            text = content if isinstance(content, str) else "".join(part["text"] for part in content)
            turns.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls") is not None:
                turns[-1]["tool_calls"].append(call)  # parallel calls belong to one assistant turn
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            turns.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return turns


async def previous_turns(find_record, scenario: str, response_id: str) -> list[dict]:
    """The conversation ``previous_response_id`` names, its reply included (its instructions left out)."""
    record_id = response_id[len(RESPONSE_PREFIX):] if response_id.startswith(RESPONSE_PREFIX) else None
    record = await asyncio.to_thread(find_record, scenario, record_id) if record_id else None
    refuse_compacted(record)  # 410 naming when its bodies were dropped, rather than a 404
    meta = (record.payload.get("responses") or {}) if record is not None and record.kind == "inference" else None
    if record is None or not meta or meta.get("store") is False:
        raise NotFound(f"Previous response with id {response_id!r} not found.", param="previous_response_id")
    try:
        messages, reply = exchange_of(record)
    except UnusableRecord as exc:
        raise NotFound(f"Previous response with id {response_id!r} has no usable answer: {exc}",
                       param="previous_response_id") from None
    if meta.get("instructions") and messages and messages[0].get("role") == "system":
        messages = messages[1:]
    return [*messages, reply]


async def chat_body(find_record, scenario: str, body: dict) -> dict:
    """The Chat Completions body a validated Responses request stands for."""
    turns: list[dict] = []
    if body.get("instructions"):
        turns.append({"role": "system", "content": body["instructions"]})
    if body.get("previous_response_id"):
        turns += await previous_turns(find_record, scenario, body["previous_response_id"])
    turns += _chat_turns(body["input"])
    chat: dict[str, Any] = {"model": body["model"], "messages": turns}
    if body.get("stream"):  # relayed live: the usage arrives as the chat stream's last chunk
        chat.update(stream=True, stream_options={"include_usage": True})
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if t.get(k) is not None}} for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice["name"]}}
    return chat


def record_entry(body: dict, record_id: str) -> dict:
    """What the record keeps of the Responses request beside the chat exchange."""
    return {"response_id": RESPONSE_PREFIX + record_id, "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True), "instructions": bool(body.get("instructions"))}


def response_object(body: dict, completion: dict, record_id: str, created_at: float) -> dict:
    """The Responses ``response`` object for a chat completion (OpenAI dialect) of request ``body``."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict] = []
    text = message.get("content")
    if isinstance(text, str) and text or not message.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{record_id}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": text or "", "annotations": [], "logprobs": []}]})
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        output.append({"type": "function_call", "id": f"fc_{record_id}_{i}",
                       "call_id": call.get("id") or f"call_{i}",
                       "name": fn.get("name") or "", "arguments": fn.get("arguments") or "{}",
                       "status": "completed"})
    usage = completion.get("usage") or {}
    prompt, done = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    incomplete = choice.get("finish_reason") == "length"
    # Every member the Open Responses ``ResponseResource`` requires, with the value this request ran with: the
    # sampling parameters it set (else the defaults the engines apply), no reasoning, no tool-call cap, no
    # background mode, no log-probs.
    return {
        "id": RESPONSE_PREFIX + record_id, "object": "response", "created_at": int(created_at),
        "completed_at": int(max(time.time(), created_at)),
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": completion.get("model") or body["model"], "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True),
        "background": False, "service_tier": "default",
        "temperature": _number(body, "temperature", 1.0), "top_p": _number(body, "top_p", 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "top_logprobs": 0, "reasoning": None,
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto", "tools": [
            {"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters") or {}, "strict": t.get("strict", False)}
            for t in body.get("tools") or []],
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": body.get("metadata") or {},
        "safety_identifier": body.get("safety_identifier"), "prompt_cache_key": body.get("prompt_cache_key"),
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                  "output_tokens": done, "output_tokens_details": {"reasoning_tokens": reasoning},
                  "total_tokens": prompt + done},
    }


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    return default if value is None else value


def in_progress(response: dict) -> dict:
    """The response as the stream's opening events show it: nothing produced, nothing completed yet."""
    return {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None,
            "completed_at": None}


def _event_stream(response: dict, record_id: str):
    """The typed Responses events of a finished response (a replayed retry), the receipt on the terminal event."""
    sequence = 0

    def event(kind: str, **fields) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    async def events():
        start = in_progress(response)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        for index, item in enumerate(response["output"]):
            for frame in _whole_item(event, item, index):
                yield frame
        terminal = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield event(terminal, response=response, reef={"agent_record_id": record_id})

    return events()


def answer(body: dict, completion: dict, record_id: str, created_at: float,
           headers: dict) -> JSONResponse | StreamingResponse:
    """The client's answer: the response object, or its event stream when the request asked for one."""
    response = response_object(body, completion, record_id, created_at)
    if body.get("stream"):
        return StreamingResponse(_event_stream(response, record_id), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", **{k: v for k, v in headers.items()
                                                                          if k.startswith(HEADER_PREFIX)}})
    return JSONResponse(response, headers=headers)



class LiveStream:
    """The typed Responses events of a chat stream, written as its OpenAI chunks arrive.

    Item ids are those :func:`response_object` gives the finished answer (``msg_<receipt>``, ``fc_<receipt>_<i>``),
    so the terminal event's response names the items the deltas built. Items open in the order the answer produces
    them; an item the chunks never opened (an empty answer's message) is emitted whole at the end."""

    def __init__(self, body: dict, record_id: str, created_at: float):
        self.body, self.record_id, self.created_at = body, record_id, created_at
        self.sequence = 0
        self.order: list[str] = []  # item ids, in output order
        self.text: str | None = None  # the open message's text so far (None: no message open)
        self.calls: dict[int, dict] = {}  # chat tool-call index -> the function_call item being built
        self.closed: set[str] = set()

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self, model: str | None) -> list[bytes]:
        shell = response_object(self.body, {"model": model, "choices": [{"message": {"content": None}}]},
                                self.record_id, self.created_at)
        shell = in_progress(shell)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def feed(self, chunk: Any) -> list[bytes]:
        """Events for one chat chunk (the usage chunk and Reef's receipt chunk carry none)."""
        out: list[bytes] = []
        if not isinstance(chunk, dict):
            return out
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
        return out

    def _message_id(self) -> str:
        return f"msg_{self.record_id}"

    def _text_delta(self, text: str) -> list[bytes]:
        out, item_id = [], self._message_id()
        if item_id in self.closed:
            return out  # text after the calls: kept in the final response only
        if self.text is None:
            self.text = ""
            self.order.append(item_id)
            index = len(self.order) - 1
            out.append(self._event("response.output_item.added", output_index=index, item={
                "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}))
            out.append(self._event("response.content_part.added", item_id=item_id, output_index=index,
                                   content_index=0, part=_text_part("")))
        self.text += text
        out.append(self._event("response.output_text.delta", item_id=item_id, output_index=self._index(item_id),
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _close_message(self) -> list[bytes]:
        item_id = self._message_id()
        if self.text is None or item_id in self.closed:
            return []
        self.closed.add(item_id)
        index, text = self._index(item_id), self.text
        item = {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
                "content": [_text_part(text)]}
        return [self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                            part=_text_part(text)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_delta(self, call: dict) -> list[bytes]:
        out: list[bytes] = []
        position = call.get("index", 0)
        fn = call.get("function") or {}
        item = self.calls.get(position)
        if item is None:
            out += self._close_message()  # Responses items follow one another
            item = {"type": "function_call", "id": f"fc_{self.record_id}_{len(self.calls)}",
                    "call_id": call.get("id") or f"call_{len(self.calls)}", "name": fn.get("name") or "",
                    "arguments": "", "status": "in_progress"}
            self.calls[position] = item
            self.order.append(item["id"])
            out.append(self._event("response.output_item.added", output_index=self._index(item["id"]),
                                   item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self._index(item["id"]), delta=fn["arguments"]))
        return out

    def _index(self, item_id: str) -> int:
        return self.order.index(item_id)

    def finish(self, response: dict) -> list[bytes]:
        """Close what is open, add what never opened, and end with the finished response and the receipt."""
        out = self._close_message()
        final = {item["id"]: item for item in response["output"]}
        for item in self.calls.values():
            if item["id"] in self.closed:
                continue
            self.closed.add(item["id"])
            done = final.get(item["id"], {**item, "status": "completed"})
            index = self._index(item["id"])
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=done["arguments"], name=done["name"]))
            out.append(self._event("response.output_item.done", output_index=index, item=done))
        for item_id, item in final.items():
            if item_id not in self.order:
                self.order.append(item_id)
                out += _whole_item(self._event, item, self._index(item_id))
        response = {**response, "output": [final[i] for i in self.order if i in final]}
        terminal = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._event(terminal, response=response, reef={"agent_record_id": self.record_id}))
        return out

    def error(self, message: str, record_id: str | None) -> list[bytes]:
        """The stream failed after its headers left: Responses' ``error`` event (the receipt of what was kept)."""
        # The spec's ``error`` payload, and its members at the top level too, where the OpenAI SDKs read them.
        fields = {"code": "upstream_error", "message": message, "param": None,
                  "error": {"type": "server_error", "code": "upstream_error", "message": message, "param": None}}
        if record_id:
            fields["reef"] = {"agent_record_id": record_id, "complete": False}
        return [self._event("error", **fields)]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _whole_item(event, item: dict, index: int) -> list[bytes]:
    """Every event of one finished output item, from added to done."""
    out = []
    if item["type"] == "message":
        text = item["content"][0]["text"]
        out.append(event("response.output_item.added", output_index=index,
                         item={**item, "status": "in_progress", "content": []}))
        out.append(event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                         part=_text_part("")))
        if text:
            out.append(event("response.output_text.delta", item_id=item["id"], output_index=index,
                             content_index=0, delta=text, logprobs=[]))
        out.append(event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                         text=text, logprobs=[]))
        out.append(event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                         part=_text_part(text)))
    else:
        out.append(event("response.output_item.added", output_index=index,
                         item={**item, "status": "in_progress", "arguments": ""}))
        out.append(event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                         delta=item["arguments"]))
        out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         arguments=item["arguments"], name=item["name"]))
    out.append(event("response.output_item.done", output_index=index, item=item))
    return out


# -- passthrough (engine.upstream_responses) ----------------------------------------------------------------------

#: The events that end a Responses stream.
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesAccumulator:
    """What a passed-through Responses stream carried: the response of its terminal event (the record's answer)."""

    def __init__(self):
        self.complete = False
        self.response: dict | None = None

    def feed(self, event) -> None:
        data = event.data
        if isinstance(data, dict) and isinstance(data.get("response"), dict):
            self.response = data["response"]
            self.complete = self.complete or data.get("type") in TERMINAL_EVENTS

    def body(self) -> dict | None:
        return self.response


def is_terminal(data: Any) -> bool:
    return isinstance(data, dict) and data.get("type") in TERMINAL_EVENTS


def frame(data: dict) -> bytes:
    return f"event: {data.get('type')}\ndata: {json.dumps(data)}\n\n".encode()


def passthrough_answer(response: dict, record_id: str, stream: bool, headers: dict) -> JSONResponse | StreamingResponse:
    """A passed-through response answered from what is stored (a replayed retry, or a provider that did not stream):
    the object itself, or its typed event sequence."""
    if stream:
        return StreamingResponse(_event_stream(response, record_id), media_type="text/event-stream",
                                 headers={"cache-control": "no-store"})
    return JSONResponse(response, headers=headers)
