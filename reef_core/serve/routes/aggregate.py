"""Stream bookkeeping: rebuild a complete response body from stream events, and the reverse.

Records of streamed replies keep the same ``response`` shape as non-streamed ones, so
processors never care how a reply was delivered.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from reef_core.engines.base import StreamEvent
from reef_core.engines.sse import encode_event


class OpenAIAccumulator:
    """Fold ``chat.completion.chunk`` events into one ``chat.completion`` body."""

    def __init__(self):
        self.meta: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage = None
        self.complete = False

    def feed(self, event: StreamEvent) -> None:
        if event.data == "[DONE]":
            self.complete = True
            return
        chunk = event.data
        if not isinstance(chunk, dict):
            return
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in self.meta:
                self.meta[key] = chunk[key]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            slot = self.choices.setdefault(choice.get("index", 0), {"content": [], "role": "assistant",
                                                                     "finish_reason": None, "tool_calls": {}})
            delta = choice.get("delta") or {}
            if delta.get("role"):
                slot["role"] = delta["role"]
            if delta.get("content"):
                slot["content"].append(delta["content"])
            for call in delta.get("tool_calls") or ():
                entry = slot["tool_calls"].setdefault(call.get("index", 0), {"id": None, "type": "function",
                                                                           "function": {"name": "", "arguments": ""}})
                if call.get("id"):
                    entry["id"] = call["id"]
                function = call.get("function") or {}
                entry["function"]["name"] += function.get("name") or ""
                entry["function"]["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                slot["finish_reason"] = choice["finish_reason"]

    def body(self) -> dict:
        choices = []
        for index in sorted(self.choices):
            slot = self.choices[index]
            message: dict[str, Any] = {"role": slot["role"], "content": "".join(slot["content"])}
            if slot["tool_calls"]:
                message["tool_calls"] = [slot["tool_calls"][i] for i in sorted(slot["tool_calls"])]
            choices.append({"index": index, "message": message, "finish_reason": slot["finish_reason"]})
        body = {"object": "chat.completion", **self.meta, "choices": choices}
        if self.usage:
            body["usage"] = self.usage
        return body


class AnthropicAccumulator:
    """Fold Anthropic stream events into one ``message`` body."""

    def __init__(self):
        self.message: dict[str, Any] = {}
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, list[str]] = {}
        self.complete = False

    def feed(self, event: StreamEvent) -> None:
        data = event.data if isinstance(event.data, dict) else {}
        kind = data.get("type") or event.event
        if kind == "message_start":
            self.message = dict(data.get("message") or {})
        elif kind == "content_block_start":
            self.blocks[data.get("index", 0)] = dict(data.get("content_block") or {})
        elif kind == "content_block_delta":
            block = self.blocks.setdefault(data.get("index", 0), {"type": "text", "text": ""})
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif delta.get("type") == "input_json_delta":
                self.partial_json.setdefault(data.get("index", 0), []).append(delta.get("partial_json", ""))
            elif delta.get("type") == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
        elif kind == "message_delta":
            delta = data.get("delta") or {}
            self.message.update({k: v for k, v in delta.items() if v is not None})
            if data.get("usage"):
                self.message["usage"] = {**(self.message.get("usage") or {}), **data["usage"]}
        elif kind == "message_stop":
            self.complete = True

    def body(self) -> dict:
        content = []
        for index in sorted(self.blocks):
            block = dict(self.blocks[index])
            if index in self.partial_json:
                text = "".join(self.partial_json[index])
                try:
                    block["input"] = json.loads(text) if text else {}
                except ValueError:
                    block["input"] = {"_unparsed": text}
            content.append(block)
        return {"type": "message", "role": "assistant", **self.message, "content": content}


def receipt_events(dialect: str, record_id: str, model: str | None) -> list[StreamEvent]:
    """The end of a recorded stream carrying its receipt: an extra OpenAI chunk then ``[DONE]``, or the
    Anthropic ``message_stop`` with a ``reef`` field."""
    if dialect == "openai":
        chunk = {"id": f"chatcmpl-{record_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": model or "reef", "choices": [], "reef": {"agent_record_id": record_id}}
        return [StreamEvent(None, chunk), StreamEvent(None, "[DONE]")]
    return [StreamEvent("message_stop", {"type": "message_stop", "reef": {"agent_record_id": record_id}})]


def accumulator_for(dialect: str):
    return OpenAIAccumulator() if dialect == "openai" else AnthropicAccumulator()


async def synthetic_stream(dialect: str, body: dict, record_id: str) -> AsyncIterator[bytes]:
    """Replay a stored complete response as a stream (a retried streaming request)."""
    events: list[StreamEvent] = []
    if dialect == "openai":
        base = {"id": body.get("id", f"chatcmpl-{record_id}"), "object": "chat.completion.chunk",
                "created": body.get("created", int(time.time())), "model": body.get("model", "reef")}
        for choice in body.get("choices") or ():
            message = choice.get("message") or {}
            events.append(StreamEvent(None, {**base, "choices": [{"index": choice.get("index", 0), "delta": {
                "role": "assistant", "content": message.get("content") or ""}, "finish_reason": None}]}))
            events.append(StreamEvent(None, {**base, "choices": [{"index": choice.get("index", 0), "delta": {},
                                                                  "finish_reason": choice.get("finish_reason")}]}))
    else:
        start = {k: v for k, v in body.items() if k != "content"}
        start.update({"content": [], "stop_reason": None})
        events.append(StreamEvent("message_start", {"type": "message_start", "message": start}))
        for index, block in enumerate(body.get("content") or ()):
            if block.get("type") != "text":
                continue
            events.append(StreamEvent("content_block_start", {"type": "content_block_start", "index": index,
                                                              "content_block": {"type": "text", "text": ""}}))
            events.append(StreamEvent("content_block_delta", {"type": "content_block_delta", "index": index,
                                                              "delta": {"type": "text_delta", "text": block["text"]}}))
            events.append(StreamEvent("content_block_stop", {"type": "content_block_stop", "index": index}))
        events.append(StreamEvent("message_delta", {"type": "message_delta",
                                                    "delta": {"stop_reason": body.get("stop_reason"),
                                                              "stop_sequence": body.get("stop_sequence")},
                                                    "usage": {"output_tokens": (body.get("usage") or {}).get(
                                                        "output_tokens", 0)}}))
    events.extend(receipt_events(dialect, record_id, body.get("model")))
    for event in events:
        yield encode_event(event)
