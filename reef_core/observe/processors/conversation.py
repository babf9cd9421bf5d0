"""Dialect-free views of an inference record: its chat messages and the assistant reply.

Both dialects normalise to OpenAI-style turns ``{"role", "content"}`` with text content, plus ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments"}}]``) on assistant turns that call tools and
``tool_call_id`` on ``tool`` turns. Anthropic's ``system`` becomes a leading system turn, ``tool_use`` blocks become
``tool_calls`` and each ``tool_result`` block becomes its own ``tool`` turn. Thinking blocks and non-text media are
left out: they are not part of the transcript a client resends. The normaliser never raises on odd content; a record
whose body is not a chat exchange at all raises :class:`UnusableRecord`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from reef_core.content import content_text
from reef_core.topk import TopK
from reef_core.observe.model import Record

#: Inference routes that produce a chat exchange (``count_tokens`` records are not trainable).
CHAT_ROUTES = ("chat", "messages")


class UnusableRecord(ValueError):
    """The record holds no chat exchange a sample can be built from (wrong route, missing reply, ...)."""


def _text(content: Any) -> str:
    # A conversation sample keeps the words; images and other non-text parts carry no text to learn from.
    return content_text(content, non_text="skip")


def _arguments(value: Any) -> str:
    """Tool-call arguments as canonical JSON text (Anthropic gives an object, OpenAI a JSON string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _openai_tool_calls(calls: Any) -> list[dict]:
    out = []
    for call in calls or ():
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function.get("name"), "arguments": _arguments(function.get("arguments"))}})
    return out


def _openai_message(message: Any) -> dict | None:
    if not isinstance(message, dict):
        return None
    role = message.get("role")
    if role == "developer":
        role = "system"
    elif role == "function":  # the legacy function-result role
        role = "tool"
    if not isinstance(role, str):
        return None
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    calls = _openai_tool_calls(message.get("tool_calls"))
    if calls:
        out["tool_calls"] = calls
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def _anthropic_turns(role: Any, content: Any) -> list[dict]:
    """One Anthropic message as normalised turns: tool results first (each its own turn), then the text turn."""
    if not isinstance(role, str):
        return []
    if not isinstance(content, list):
        return [{"role": role, "content": _text(content)}]
    turns: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text") or ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": _arguments(block.get("input", {}))}})
        elif kind == "tool_result":
            turns.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                          "content": _text(block.get("content"))})
    if texts or calls or not turns:
        turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def request_messages(dialect: str, request: Any) -> list[dict]:
    """The normalised chat turns of a request body in ``dialect`` (``openai`` or ``anthropic``)."""
    if not isinstance(request, dict):
        raise UnusableRecord("the request body is not an object")
    raw = request.get("messages")
    if not isinstance(raw, list):
        raise UnusableRecord("the request has no messages")
    if dialect == "anthropic":
        messages: list[dict] = []
        system = _text(request.get("system"))
        if system:
            messages.append({"role": "system", "content": system})
        for message in raw:
            if isinstance(message, dict):
                messages.extend(_anthropic_turns(message.get("role"), message.get("content")))
        return messages
    return [m for m in (_openai_message(x) for x in raw) if m is not None]


def response_message(dialect: str, response: Any) -> dict:
    """The normalised assistant turn of a response body (the first choice of an OpenAI completion)."""
    if not isinstance(response, dict):
        raise UnusableRecord("the response body is not an object")
    if dialect == "anthropic":
        if response.get("type") == "error" or not isinstance(response.get("content"), list):
            raise UnusableRecord("the response has no content")
        turns = _anthropic_turns("assistant", response["content"])
        return turns[-1]
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UnusableRecord("the response has no choices")
    found = choices[0].get("message")
    if found is not None and not isinstance(found, dict):  # an imported answer is client input
        raise UnusableRecord("the response's choices[0].message is not an object")
    message = _openai_message({"role": "assistant", **(found or {})})
    if message is None:
        raise UnusableRecord("the response has no message")
    message["role"] = "assistant"
    return message


def exchange_of(record: Record) -> tuple[list[dict], dict]:
    """``(messages, assistant_message)`` of an inference record; raises :class:`UnusableRecord`."""
    if record.kind != "inference":
        raise UnusableRecord("not an inference record")
    payload = record.payload
    if payload.get("route", "chat") not in CHAT_ROUTES:
        raise UnusableRecord(f"route {payload.get('route')!r} is not a chat exchange")
    dialect = payload.get("dialect", "openai")
    return request_messages(dialect, payload.get("request")), response_message(dialect, payload.get("response"))


def conversation_of(record: Record) -> tuple[list[dict], str]:
    """``(messages, assistant_text)`` of an inference record, whatever its dialect (see the module docstring)."""
    messages, reply = exchange_of(record)
    return messages, reply.get("content") or ""


def tokens_of(record: Record) -> dict | None:
    """The engine's token data of an inference record, when it captured any; with the record's top-K log-probs
    under ``"top_k"`` (a :class:`~reef_core.topk.TopK`) when the engine kept them."""
    tokens = record.payload.get("tokens")
    if not isinstance(tokens, dict):
        return None
    tokens = dict(tokens)
    if record.top_k is not None:
        tokens["top_k"] = TopK.unpack(record.top_k)
    return tokens


# -- comparing transcripts -------------------------------------------------------------------------------------------


def message_key(message: dict) -> str:
    """A comparison key for one turn that ignores what clients change when they resend history: surrounding
    whitespace, tool-call argument formatting, key order and extra fields."""
    calls = [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
             for c in message.get("tool_calls") or ()]
    key = [message.get("role"), (message.get("content") or "").strip(), calls, message.get("tool_call_id")]
    return json.dumps(key, separators=(",", ":"), ensure_ascii=False)


def common_prefix(a: list[dict], b: list[dict]) -> int:
    """Number of leading turns ``a`` and ``b`` share (by :func:`message_key`)."""
    n = 0
    for x, y in zip(a, b):
        if message_key(x) != message_key(y):
            break
        n += 1
    return n


def transcript_hash(messages: list[dict]) -> str:
    """A digest of a whole transcript (by :func:`message_key`)."""
    return prefix_hashes(messages)[-1]


def prefix_hashes(messages: list[dict]) -> list[str]:
    """``hashes[k]`` is the digest of ``messages[:k]`` (``k`` = 0..len), computed in one pass."""
    digest = hashlib.sha256(b"reef-transcript")
    hashes = [digest.hexdigest()]
    for message in messages:
        digest.update(message_key(message).encode("utf-8"))
        digest.update(b"\x00")
        hashes.append(digest.hexdigest())
    return hashes
