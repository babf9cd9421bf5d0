"""Dialect translation between OpenAI Chat Completions and Anthropic Messages.

Pure functions for requests, responses and error bodies, and two small stateful classes for streams
(``feed(event) -> list[StreamEvent]``, ``finish() -> list[StreamEvent]``). Everything that has a
faithful counterpart is translated (system prompt, text and image content, tool definitions, tool
calls and tool results, sampling parameters, stop sequences, usage); what would silently change the
meaning of a request (``n > 1``, log-probs, JSON response formats, server tools, temperature above
Anthropic's range, documents) is refused with :class:`ValidationFailed`. Parameters without an
effect on the answer's content (``seed``, ``stream_options``, ``store``, ``thinking``...) are dropped.

Reef-internal stream events (``reef.*``) pass through both stream translators untouched, at their
position in the stream.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from reef_core.engines.base import StreamEvent
from reef_core.content import content_text
from reef_core.errors import UpstreamError, ValidationFailed


def _text_of(content: Any, where: str) -> str:
    # Translation refuses what it cannot carry to the other dialect rather than dropping it.
    return content_text(content, non_text="raise", where=where)


def _tool_result_text(content: Any, where: str) -> str:
    # Anthropic tool results become one OpenAI tool message: their text blocks, one per line.
    return content_text(content, non_text="raise", separator="\n", where=where)

DEFAULT_MAX_TOKENS = 4096

# ---------------------------------------------------------------------------------------------------------
# stop / finish reasons

_FINISH_TO_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
_STOP_TO_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def finish_to_stop_reason(finish_reason: str | None) -> str | None:
    """OpenAI ``finish_reason`` -> Anthropic ``stop_reason`` (unknown reasons end the turn)."""
    if finish_reason is None:
        return None
    return _FINISH_TO_STOP.get(finish_reason, "end_turn")


def stop_to_finish_reason(stop_reason: str | None) -> str | None:
    """Anthropic ``stop_reason`` -> OpenAI ``finish_reason``."""
    if stop_reason is None:
        return None
    return _STOP_TO_FINISH.get(stop_reason, "stop")


# ---------------------------------------------------------------------------------------------------------
# content helpers



def _openai_part_to_block(part: Any, where: str) -> dict:
    if not isinstance(part, dict):
        raise ValidationFailed(f"{where}: content parts must be objects")
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part.get("text", "")}
    if kind == "image_url":
        url = (part.get("image_url") or {}).get("url", "")
        if url.startswith("data:"):
            head, _, data = url.partition(",")
            media = head[5:].split(";")[0]
            if ";base64" not in head or not media:
                raise ValidationFailed(f"{where}: image data URLs must be base64 with a media type")
            return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
        if url.startswith(("http://", "https://")):
            return {"type": "image", "source": {"type": "url", "url": url}}
        raise ValidationFailed(f"{where}: unsupported image URL")
    raise ValidationFailed(f"{where}: content part type {kind!r} cannot be translated to Anthropic")


def _anthropic_block_to_part(block: dict, where: str) -> dict:
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block.get("text", "")}
    if kind == "image":
        src = block.get("source") or {}
        if src.get("type") == "base64":
            return {"type": "image_url", "image_url": {"url": f"data:{src.get('media_type')};base64,{src.get('data')}"}}
        if src.get("type") == "url":
            return {"type": "image_url", "image_url": {"url": src.get("url")}}
        raise ValidationFailed(f"{where}: image source {src.get('type')!r} cannot be translated to OpenAI")
    raise ValidationFailed(f"{where}: content block type {kind!r} cannot be translated to OpenAI")



def _refuse_untranslatable_openai(body: Any) -> list:
    """Refuse what an OpenAI body asks that Anthropic cannot do alike; the body's messages, checked to be a list."""
    if not isinstance(body, dict):
        raise ValidationFailed("request body must be a JSON object")
    if (body.get("n") or 1) != 1:
        raise ValidationFailed("n > 1 cannot be translated to Anthropic")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ValidationFailed("logprobs cannot be translated to Anthropic")
    rf = body.get("response_format")
    if rf and rf.get("type", "text") != "text":
        raise ValidationFailed(f"response_format {rf.get('type')!r} cannot be translated to Anthropic")
    if body.get("functions") or body.get("function_call"):
        raise ValidationFailed("legacy functions/function_call cannot be translated; use tools")
    if body.get("logit_bias"):
        raise ValidationFailed("logit_bias cannot be translated to Anthropic")
    if body.get("audio") or any(m != "text" for m in body.get("modalities") or []):
        raise ValidationFailed("audio output cannot be translated to Anthropic")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValidationFailed("messages must be a non-empty list")
    return messages


def _openai_user_blocks(content: Any, where: str) -> list[dict]:
    """An OpenAI user message's content as Anthropic content blocks."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [_openai_part_to_block(p, where) for p in content]
    raise ValidationFailed(f"{where}: user content must be a string or a list of parts")


def _openai_assistant_blocks(m: dict, where: str) -> list[dict]:
    """An OpenAI assistant message (its text, refusals left out, and its tool calls) as Anthropic content blocks."""
    content = m.get("content")
    blocks: list[dict] = []
    text = _text_of(content, where) if not isinstance(content, list) else _text_of(
        [p for p in content if p.get("type") != "refusal"], where)
    if text:
        blocks.append({"type": "text", "text": text})
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args)
        except ValueError as exc:
            raise ValidationFailed(f"{where}: tool call arguments are not JSON") from exc
        blocks.append({"type": "tool_use", "id": tc.get("id"), "name": fn.get("name"), "input": parsed})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


def _openai_messages_to_anthropic(messages: list) -> tuple[list[str], list[dict]]:
    """OpenAI messages as (the system texts, Anthropic turns): consecutive messages of one role merge into one turn,
    tool results into a user turn; a turn of a single text block is sent as a plain string."""
    system: list[str] = []
    turns: list[dict] = []  # {"role", "content": [blocks]}

    def push(role: str, blocks: list[dict]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": list(blocks)})

    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValidationFailed(f"{where} must be an object")
        role = m.get("role")
        content = m.get("content")
        if role in ("system", "developer"):
            system.append(_text_of(content, where))
        elif role == "user":
            push("user", _openai_user_blocks(content, where))
        elif role == "assistant":
            push("assistant", _openai_assistant_blocks(m, where))
        elif role == "tool":
            push("user", [{"type": "tool_result", "tool_use_id": m.get("tool_call_id"),
                           "content": _text_of(content, where)}])
        else:
            raise ValidationFailed(f"{where}: role {role!r} cannot be translated to Anthropic")

    # A single text block is sent as a plain string: the most widely accepted form.
    for t in turns:
        if len(t["content"]) == 1 and t["content"][0]["type"] == "text":
            t["content"] = t["content"][0]["text"]
    return system, turns


def _openai_sampling_to_anthropic(body: dict) -> dict[str, Any]:
    """Temperature (at most 1), top_p, stop sequences, streaming and the end user, in Anthropic's fields."""
    out: dict[str, Any] = {}
    if body.get("temperature") is not None:
        temp = float(body["temperature"])
        if temp > 1.0:
            raise ValidationFailed("temperature above 1 is outside Anthropic's range [0, 1]")
        out["temperature"] = temp
    if body.get("top_p") is not None:
        out["top_p"] = body["top_p"]
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("stream"):
        out["stream"] = True
    if body.get("user"):
        out["metadata"] = {"user_id": str(body["user"])}
    return out


def _openai_tools_to_anthropic(tools: list) -> list[dict]:
    """OpenAI function tool definitions as Anthropic tools (only function tools translate)."""
    out = []
    for j, t in enumerate(tools):
        if t.get("type") != "function":
            raise ValidationFailed(f"tools[{j}]: only function tools can be translated to Anthropic")
        fn = t.get("function") or {}
        tool = {"name": fn.get("name"),
                "input_schema": fn.get("parameters") or {"type": "object", "properties": {}}}
        if fn.get("description"):
            tool["description"] = fn["description"]
        out.append(tool)
    return out


def _openai_tool_choice_to_anthropic(body: dict) -> dict[str, Any] | None:
    """``tool_choice`` and ``parallel_tool_calls`` as Anthropic's ``tool_choice`` (None: not sent)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    tc_out: dict[str, Any] | None = None
    if choice == "auto":
        tc_out = {"type": "auto"}
    elif choice == "required":
        tc_out = {"type": "any"}
    elif choice == "none":
        tc_out = {"type": "none"}
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not name:
            raise ValidationFailed("tool_choice cannot be translated to Anthropic")
        tc_out = {"type": "tool", "name": name}
    elif choice is not None:
        raise ValidationFailed(f"tool_choice {choice!r} cannot be translated to Anthropic")
    if body.get("parallel_tool_calls") is False and tools:
        tc_out = tc_out or {"type": "auto"}
        tc_out["disable_parallel_tool_use"] = True
    return tc_out if tools else None


def openai_to_anthropic_request(body: dict, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
    """Translate an OpenAI chat.completions request body into an Anthropic messages body.

    System and developer messages are hoisted into ``system``; consecutive messages of one role are
    merged (tool results become ``tool_result`` blocks of a user turn); ``max_tokens`` defaults to
    ``default_max_tokens`` because Anthropic requires it.
    """
    messages = _refuse_untranslatable_openai(body)
    system, turns = _openai_messages_to_anthropic(messages)
    out: dict[str, Any] = {"model": body.get("model"), "messages": turns}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    out["max_tokens"] = int(max_tokens)
    system = [s for s in system if s]
    if system:
        out["system"] = "\n\n".join(system)
    out.update(_openai_sampling_to_anthropic(body))
    tools = body.get("tools")
    if tools:
        out["tools"] = _openai_tools_to_anthropic(tools)
    tc_out = _openai_tool_choice_to_anthropic(body)
    if tc_out is not None:
        out["tool_choice"] = tc_out
    return out


def _anthropic_system_to_openai(system: Any) -> list[dict]:
    """Anthropic's ``system`` (a string or text blocks) as the OpenAI system message it becomes (none if empty)."""
    if not system:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": _tool_result_text(system, "system")}]
    raise ValidationFailed("system must be a string or a list of text blocks")


def _anthropic_assistant_to_openai(content: list, where: str) -> dict:
    """An Anthropic assistant turn's blocks as one OpenAI assistant message (text and tool calls; reasoning dropped)."""
    texts: list[str] = []
    calls: list[dict] = []
    for b in content:
        kind = b.get("type")
        if kind == "text":
            texts.append(b.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"),
                                       "arguments": json.dumps(b.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # reasoning traces have no OpenAI chat counterpart
        else:
            raise ValidationFailed(f"{where}: assistant block {kind!r} cannot be translated to OpenAI")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _anthropic_user_to_openai(content: list, where: str) -> list[dict]:
    """An Anthropic user turn's blocks as OpenAI messages: one tool message per tool result, then the rest as one
    user message (a single text part as a plain string)."""
    out_msgs: list[dict] = []
    parts: list[dict] = []
    for b in content:
        if b.get("type") == "tool_result":
            text = _tool_result_text(b.get("content"), where)
            if b.get("is_error"):
                text = f"Error: {text}"
            out_msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            parts.append(_anthropic_block_to_part(b, where))
    if parts:
        if all(p["type"] == "text" for p in parts) and len(parts) == 1:
            out_msgs.append({"role": "user", "content": parts[0]["text"]})
        else:
            out_msgs.append({"role": "user", "content": parts})
    return out_msgs


def _anthropic_messages_to_openai(messages: list) -> list[dict]:
    """Anthropic user and assistant turns as OpenAI messages."""
    out_msgs: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValidationFailed(f"{where} must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ValidationFailed(f"{where}: role {role!r} is not an Anthropic role")
        if isinstance(content, str):
            out_msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValidationFailed(f"{where}: content must be a string or a list of blocks")
        if role == "assistant":
            out_msgs.append(_anthropic_assistant_to_openai(content, where))
        else:
            out_msgs.extend(_anthropic_user_to_openai(content, where))
    return out_msgs


def _anthropic_sampling_to_openai(body: dict) -> dict[str, Any]:
    """max_tokens, temperature, top_p, stop sequences, streaming (with usage) and the end user, in OpenAI's fields."""
    out: dict[str, Any] = {}
    if body.get("max_tokens") is not None:
        out["max_tokens"] = int(body["max_tokens"])
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    user = (body.get("metadata") or {}).get("user_id")
    if user:
        out["user"] = user
    return out


def anthropic_tools_to_openai(tools: list) -> list[dict]:
    """Anthropic custom tool definitions as OpenAI function tools (server tools do not translate)."""
    out = []
    for j, t in enumerate(tools):
        if t.get("type") not in (None, "custom") or "input_schema" not in t:
            raise ValidationFailed(f"tools[{j}]: server tool {t.get('type') or t.get('name')!r} cannot be "
                                   "translated to OpenAI")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _anthropic_tool_choice_to_openai(choice: dict) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as OpenAI's ``tool_choice`` (and ``parallel_tool_calls``)."""
    out: dict[str, Any] = {}
    kind = choice.get("type")
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise ValidationFailed(f"tool_choice {kind!r} cannot be translated to OpenAI")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def anthropic_to_openai_request(body: dict) -> dict:
    """Translate an Anthropic messages request body into an OpenAI chat.completions body.

    ``tool_result`` blocks become ``tool`` messages placed before the rest of their user turn; a stream
    asks for ``stream_options.include_usage`` so usage can be reported back in Anthropic's
    ``message_delta``. ``top_k`` and ``thinking`` are dropped (no OpenAI counterpart).
    """
    if not isinstance(body, dict):
        raise ValidationFailed("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValidationFailed("messages must be a list")
    out_msgs = _anthropic_system_to_openai(body.get("system"))
    out_msgs.extend(_anthropic_messages_to_openai(messages))
    out: dict[str, Any] = {"model": body.get("model"), "messages": out_msgs}
    out.update(_anthropic_sampling_to_openai(body))
    tools = body.get("tools")
    if tools:
        out["tools"] = anthropic_tools_to_openai(tools)
    choice = body.get("tool_choice")
    if choice and tools:
        out.update(_anthropic_tool_choice_to_openai(choice))
    return out


def anthropic_count_tokens_to_openai(body: dict) -> dict:
    """An Anthropic count_tokens body (messages, system, tools) as an OpenAI chat body, for tokenizing."""
    b = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools", "tool_choice")}
    return anthropic_to_openai_request(b)


# ---------------------------------------------------------------------------------------------------------
# responses


def anthropic_usage(input_tokens: int = 0, output_tokens: int = 0, cache_read: int = 0,
                    thinking_tokens: int | None = None) -> dict:
    """An Anthropic ``usage`` object with every member the published schema requires (``Usage``: nullable ones
    null where Reef has no value: ``inference_geo``, ``server_tool_use``; ``output_tokens_details`` only when the
    engine counted reasoning tokens)."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cache_read,
            "cache_creation": {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0},
            "inference_geo": None,
            "output_tokens_details": None if thinking_tokens is None else {"thinking_tokens": thinking_tokens},
            "server_tool_use": None, "service_tier": "standard"}


def anthropic_delta_usage(usage: dict) -> dict:
    """The ``message_delta`` event's usage (``MessageDeltaUsage``: every member required, nullable ones null)."""
    return {"input_tokens": usage.get("input_tokens"), "output_tokens": int(usage.get("output_tokens") or 0),
            "cache_creation_input_tokens": usage.get("cache_creation_input_tokens"),
            "cache_read_input_tokens": usage.get("cache_read_input_tokens"),
            "output_tokens_details": usage.get("output_tokens_details"), "server_tool_use": None}


def anthropic_tool_use(call_id: str | None, name: str | None, tool_input: Any) -> dict:
    """A ``tool_use`` content block as the spec's ``ResponseToolUseBlock`` has it: a client tool called directly by
    the model (``caller``), an id of ``[a-zA-Z0-9_-]`` only, an object ``input``."""
    ident = re.sub(r"[^a-zA-Z0-9_-]", "_", call_id) if call_id else f"toolu_{uuid.uuid4().hex[:24]}"
    if not isinstance(tool_input, dict):
        tool_input = {"_raw_arguments": json.dumps(tool_input)}
    return {"type": "tool_use", "id": ident, "name": name or "", "input": tool_input, "caller": {"type": "direct"}}


def _usage_openai_to_anthropic(usage: dict | None) -> dict:
    usage = usage or {}
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return anthropic_usage(int(usage.get("prompt_tokens") or 0) - cached, int(usage.get("completion_tokens") or 0),
                           cached, int(reasoning) if isinstance(reasoning, int) and reasoning > 0 else None)


def _usage_anthropic_to_openai(usage: dict | None) -> dict:
    usage = usage or {}
    cached = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _tool_input(arguments: str | None) -> Any:
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        # A model that emitted broken JSON: keep the text rather than lose it.
        return {"_raw_arguments": arguments}


def _msg_id(openai_id: str | None) -> str:
    if openai_id and openai_id.startswith("msg_"):
        return openai_id
    return f"msg_{openai_id or uuid.uuid4().hex}"


def _chat_id(anthropic_id: str | None) -> str:
    if anthropic_id and anthropic_id.startswith("chatcmpl-"):
        return anthropic_id
    return f"chatcmpl-{anthropic_id or uuid.uuid4().hex}"


def openai_to_anthropic_response(body: dict) -> dict:
    """Translate an OpenAI chat.completion body into an Anthropic message body (first choice)."""
    choices = body.get("choices") or []
    if not choices:
        raise UpstreamError("provider answer has no choices")
    choice = choices[0]
    msg = choice.get("message") or {}
    content: list[dict] = []
    text = msg.get("content")
    if isinstance(text, list):  # a provider's typed reply: its text parts (others have no Anthropic twin here)
        text = content_text(text, non_text="skip")
    calls = msg.get("tool_calls") or []
    if text or not calls:
        content.append({"type": "text", "text": text or "", "citations": None})
    for tc in calls:
        fn = tc.get("function") or {}
        content.append(anthropic_tool_use(tc.get("id"), fn.get("name"), _tool_input(fn.get("arguments"))))
    return {
        "id": _msg_id(body.get("id")),
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": content,
        "stop_reason": finish_to_stop_reason(choice.get("finish_reason")) or "end_turn",
        "stop_sequence": None,
        "stop_details": None,
        "usage": _usage_openai_to_anthropic(body.get("usage")),
        "container": None,
    }


def anthropic_to_openai_response(body: dict, created: int | None = None) -> dict:
    """Translate an Anthropic message body into an OpenAI chat.completion body."""
    texts: list[str] = []
    calls: list[dict] = []
    for b in body.get("content") or []:
        kind = b.get("type")
        if kind == "text":
            texts.append(b.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None,
                               "refusal": None, "annotations": []}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": _chat_id(body.get("id")),
        "object": "chat.completion",
        "created": int(created if created is not None else time.time()),
        "model": body.get("model"),
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": stop_to_finish_reason(body.get("stop_reason")) or "stop"}],
        "usage": _usage_anthropic_to_openai(body.get("usage")),
    }


_USAGE_NULLABLE = ("cache_creation", "cache_creation_input_tokens", "cache_read_input_tokens", "inference_geo",
                   "output_tokens_details", "server_tool_use", "service_tier")


def complete_anthropic_message(body: Any) -> Any:
    """An Anthropic-dialect provider's message with the members the published schema requires and the provider left
    out, each at the spec's own default (``null``; ``caller`` of a tool_use block ``{"type": "direct"}``). Members
    the provider sent are kept as sent; the body is copied, never changed in place."""
    if not isinstance(body, dict) or body.get("type") != "message":
        return body
    out = {"stop_details": None, "container": None, **body}
    if isinstance(body.get("usage"), dict):
        out["usage"] = {**{k: None for k in _USAGE_NULLABLE}, **body["usage"]}
    if isinstance(body.get("content"), list):
        blocks = []
        for block in body["content"]:
            if isinstance(block, dict) and block.get("type") == "text":
                block = {"citations": None, **block}
            elif isinstance(block, dict) and block.get("type") == "tool_use":
                block = {"caller": {"type": "direct"}, **block}
            blocks.append(block)
        out["content"] = blocks
    return out


#: Optional members of an OpenAI chat completion that the published schema allows absent but never ``null``; some
#: OpenAI-compatible servers (vLLM 0.32) send them as ``null``.
_OPENAI_NOT_NULL = {"completion": ("service_tier", "system_fingerprint", "usage"),
                    "message": ("tool_calls", "annotations", "function_call"),
                    "usage": ("completion_tokens_details", "prompt_tokens_details")}


def complete_openai_completion(body: Any) -> Any:
    """An OpenAI-dialect server's chat completion with the members it sent as ``null`` where the published schema
    has no ``null`` (:data:`_OPENAI_NOT_NULL`) left out: absent says what ``null`` meant, "not reported". Every other
    member is kept as sent; the body is copied, never changed in place."""
    if not isinstance(body, dict) or body.get("object") != "chat.completion" or not _has_bare_null(body):
        return body  # nothing to leave out: the body as it came (most providers; no copy on the relay path)

    def pruned(obj: Any, kind: str) -> Any:
        if not isinstance(obj, dict):
            return obj
        return {k: v for k, v in obj.items() if not (v is None and k in _OPENAI_NOT_NULL[kind])}

    out = pruned(body, "completion")
    if "usage" in out:
        out["usage"] = pruned(out["usage"], "usage")
    if isinstance(out.get("choices"), list):
        out["choices"] = [{**c, "message": pruned(c["message"], "message")} if isinstance(c, dict) and "message" in c
                          else c for c in out["choices"]]
    return out


def _has_bare_null(body: dict) -> bool:
    """Whether ``body`` sends a member of :data:`_OPENAI_NOT_NULL` as ``null``."""
    def bare(obj: Any, kind: str) -> bool:
        return isinstance(obj, dict) and any(k in obj and obj[k] is None for k in _OPENAI_NOT_NULL[kind])

    choices = body.get("choices")
    return bare(body, "completion") or bare(body.get("usage"), "usage") or (isinstance(choices, list) and any(
        isinstance(c, dict) and bare(c.get("message"), "message") for c in choices))


def translate_response(body: dict, src: str, dst: str) -> dict:
    """Translate a successful response body from dialect ``src`` to ``dst``; a body relayed in its own dialect is
    completed to the published schema (:func:`complete_anthropic_message`, :func:`complete_openai_completion`)."""
    if src == dst:
        return complete_anthropic_message(body) if dst == "anthropic" else complete_openai_completion(body)
    return openai_to_anthropic_response(body) if src == "openai" else anthropic_to_openai_response(body)


def translate_request(body: dict, src: str, dst: str, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
    """Translate a request body from dialect ``src`` to ``dst``."""
    if src == dst:
        return body
    if src == "openai":
        return openai_to_anthropic_request(body, default_max_tokens)
    return anthropic_to_openai_request(body)


# ---------------------------------------------------------------------------------------------------------
# error bodies

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 409: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
    429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error",
    529: "overloaded_error",
}
_OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 408: "timeout", 409: "conflict", 413: "invalid_request_error",
                       422: "invalid_request_error",
                       429: "rate_limit_error"}


def error_message(body: Any) -> str:
    """The human message inside a provider error body of either dialect (or the body as text)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
    return body if isinstance(body, str) else json.dumps(body)


def error_body(dialect: str, status: int, message: str) -> dict:
    """An error body in the native shape of ``dialect``."""
    if dialect == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": _OPENAI_ERROR_TYPES.get(status, "api_error"), "param": None,
                      "code": None}}


def translate_error(body: Any, status: int, dst: str) -> dict:
    """Re-shape a provider error body (either dialect) into ``dst``'s error shape, keeping the message."""
    return error_body(dst, status, error_message(body))


# ---------------------------------------------------------------------------------------------------------
# streams


class OpenAIToAnthropicStream:
    """OpenAI ``chat.completion.chunk`` events in, Anthropic message events out.

    Output order is the SDKs' strict one: ``message_start``, then per content block
    ``content_block_start``, ``content_block_delta``*, ``content_block_stop``, then ``message_delta`` and
    ``message_stop``. The closing events are emitted on ``[DONE]`` (after any usage chunk), or by
    :meth:`finish` for a source that ended without it. ``reef.*`` events arriving after the finish reason
    are emitted just before ``message_stop``; earlier ones pass through where they are. Tool calls become
    ``tool_use`` blocks with ``input_json_delta``s; they must arrive one after another (as every
    OpenAI-compatible server sends them): a delta for an already closed call raises :class:`UpstreamError`.
    """

    def __init__(self, model: str | None = None, message_id: str | None = None, input_tokens: int = 0):
        self.model = model
        self.message_id = message_id
        self.input_tokens = input_tokens
        self.started = False
        self.done = False
        self._block = -1  # index of the open Anthropic block, -1 none
        self._block_kind: str | None = None  # "text" | "tool"
        self._tool_blocks: dict[int, int] = {}  # OpenAI tool call index -> Anthropic block index
        self._closed_tools: set[int] = set()
        self._finish: str | None = None
        self._usage: dict | None = None
        self._held: list[StreamEvent] = []  # reef.* events seen after the finish reason

    def _start(self, chunk: dict) -> list[StreamEvent]:
        self.started = True
        self.message_id = self.message_id or _msg_id(chunk.get("id"))
        self.model = self.model or chunk.get("model")
        msg = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "stop_details": None,
               "usage": anthropic_usage(self.input_tokens), "container": None}
        return [StreamEvent("message_start", {"type": "message_start", "message": msg})]

    def _close_block(self) -> list[StreamEvent]:
        if self._block < 0 or self._block_kind is None:
            return []
        if self._block_kind == "tool":
            for oi, bi in self._tool_blocks.items():
                if bi == self._block:
                    self._closed_tools.add(oi)
        self._block_kind = None
        return [StreamEvent("content_block_stop", {"type": "content_block_stop", "index": self._block})]

    def _open_block(self, kind: str, block: dict) -> list[StreamEvent]:
        out = self._close_block()
        self._block += 1
        self._block_kind = kind
        out.append(StreamEvent("content_block_start",
                               {"type": "content_block_start", "index": self._block, "content_block": block}))
        return out

    def feed(self, ev: StreamEvent) -> list[StreamEvent]:
        if ev.is_reef:
            if self._finish is not None and not self.done:
                self._held.append(ev)  # keep it next to the terminal event, after the blocks close
                return []
            return [ev]
        if self.done:
            return []
        if ev.data == "[DONE]":
            return self._closing() if self.started else self._start({}) + self._closing()
        chunk = ev.data
        if not isinstance(chunk, dict):
            return []
        if "error" in chunk and not chunk.get("choices"):
            raise UpstreamError(f"provider stream error: {error_message(chunk)}")
        out: list[StreamEvent] = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if self._block_kind != "text":
                    out += self._open_block("text", {"type": "text", "text": "", "citations": None})
                out.append(StreamEvent("content_block_delta", {
                    "type": "content_block_delta", "index": self._block,
                    "delta": {"type": "text_delta", "text": text}}))
            for tc in delta.get("tool_calls") or []:
                oi = tc.get("index", 0)
                fn = tc.get("function") or {}
                if oi not in self._tool_blocks:
                    out += self._open_block("tool", anthropic_tool_use(tc.get("id"), fn.get("name"), {}))
                    self._tool_blocks[oi] = self._block
                elif oi in self._closed_tools:
                    raise UpstreamError("interleaved tool call deltas cannot be translated to Anthropic")
                args = fn.get("arguments")
                if args:
                    out.append(StreamEvent("content_block_delta", {
                        "type": "content_block_delta", "index": self._tool_blocks[oi],
                        "delta": {"type": "input_json_delta", "partial_json": args}}))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def _closing(self) -> list[StreamEvent]:
        self.done = True
        out = self._close_block()
        # Counts the stream did not carry are null (MessageDeltaUsage allows it), never an invented 0.
        usage = _usage_openai_to_anthropic(self._usage) if self._usage else {"output_tokens": 0}
        delta_usage = anthropic_delta_usage(usage)
        out.append(StreamEvent("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": finish_to_stop_reason(self._finish) or "end_turn", "stop_sequence": None,
                      "stop_details": None, "container": None},
            "usage": delta_usage}))
        out += self._held
        self._held = []
        out.append(StreamEvent("message_stop", {"type": "message_stop"}))
        return out

    def finish(self) -> list[StreamEvent]:
        """Close a stream whose source ended without ``[DONE]``; nothing if already closed."""
        if self.done:
            return []
        return (self._start({}) if not self.started else []) + self._closing()


class AnthropicToOpenAIStream:
    """Anthropic message events in, OpenAI ``chat.completion.chunk`` events out, ending with ``[DONE]``.

    The first chunk carries ``delta.role``; text deltas become ``delta.content``; ``tool_use`` blocks become
    ``delta.tool_calls`` (name first, then argument fragments); ``message_delta`` gives the finish chunk.
    With ``include_usage`` (the client sent ``stream_options.include_usage``) a usage chunk with empty
    ``choices`` precedes ``[DONE]``. Thinking blocks are dropped.
    """

    def __init__(self, include_usage: bool = False, created: int | None = None, model: str | None = None):
        self.include_usage = include_usage
        self.created = int(created if created is not None else time.time())
        self.model = model
        self.id: str | None = None
        self.done = False
        self._usage: dict = {}
        self._tool_index: dict[int, int] = {}  # Anthropic block index -> OpenAI tool call index
        self._finished = False

    def _chunk(self, choices: list, **extra) -> StreamEvent:
        data = {"id": self.id or _chat_id(None), "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices}
        data.update(extra)
        return StreamEvent(None, data)

    def _delta(self, delta: dict, finish: str | None = None) -> StreamEvent:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])

    def feed(self, ev: StreamEvent) -> list[StreamEvent]:
        if ev.is_reef:
            return [ev]
        if self.done or not isinstance(ev.data, dict):
            return []
        data = ev.data
        kind = data.get("type") or ev.event
        if kind == "message_start":
            msg = data.get("message") or {}
            self.id = _chat_id(msg.get("id"))
            self.model = self.model or msg.get("model")
            self._usage.update({k: v for k, v in (msg.get("usage") or {}).items() if v is not None})
            return [self._delta({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                k = len(self._tool_index)
                self._tool_index[data.get("index", 0)] = k
                return [self._delta({"tool_calls": [{"index": k, "id": block.get("id"), "type": "function",
                                                     "function": {"name": block.get("name"), "arguments": ""}}]})]
            if block.get("type") == "text" and block.get("text"):
                return [self._delta({"content": block["text"]})]
            return []
        if kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta":
                return [self._delta({"content": delta.get("text", "")})]
            if delta.get("type") == "input_json_delta" and data.get("index") in self._tool_index:
                k = self._tool_index[data["index"]]
                frag = {"index": k, "function": {"arguments": delta.get("partial_json", "")}}
                return [self._delta({"tool_calls": [frag]})]
            return []
        if kind == "message_delta":
            self._usage.update({k: v for k, v in (data.get("usage") or {}).items() if v is not None})
            reason = stop_to_finish_reason((data.get("delta") or {}).get("stop_reason")) or "stop"
            self._finished = True
            return [self._delta({}, reason)]
        if kind == "message_stop":
            return self._closing()
        if kind == "error":
            raise UpstreamError(f"provider stream error: {error_message(data)}")
        return []  # ping, content_block_stop

    def _closing(self) -> list[StreamEvent]:
        self.done = True
        out = [] if self._finished else [self._delta({}, "stop")]
        if self.include_usage:
            out.append(self._chunk([], usage=_usage_anthropic_to_openai(self._usage)))
        out.append(StreamEvent(None, "[DONE]"))
        return out

    def finish(self) -> list[StreamEvent]:
        """Close a stream whose source ended without ``message_stop``; nothing if already closed."""
        return [] if self.done else self._closing()


def stream_translator(src: str, dst: str, *, include_usage: bool = False, model: str | None = None):
    """The translator from ``src`` stream events to ``dst`` ones (``None`` when the dialects match)."""
    if src == dst:
        return None
    if src == "openai":
        return OpenAIToAnthropicStream(model=model)
    return AnthropicToOpenAIStream(include_usage=include_usage, model=model)
