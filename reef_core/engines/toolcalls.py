"""Tool calls parsed from a generated text, for engines that render the chat template themselves
(``engine.kind=local``, and ``sglang`` or ``vllm`` on a training scenario): ``engine.tool_call_parser``.

Such an engine gets plain text back; the model writes its tool calls in its chat template's format. Parsers:

* ``auto`` (default): ``hermes`` when the model's chat template writes ``<tool_call>`` blocks, else ``none``;
* ``none``: never parse (the text is the answer);
* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2/2.5/3 templates);
  the text outside the blocks stays the message content, less the whitespace next to a call.

A block that is not valid JSON with a string ``name`` (or one the generation never closed) is left in the content:
a malformed call is the model's answer, not an engine failure. :class:`ToolCallStream` splits text as it is
generated, so a stream relays content live and each call as soon as its block closes; :func:`parse_tool_calls` is the
same split over a finished text, so a streamed and a plain answer agree.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..errors import ConfigError, ValidationFailed

PARSERS = ("auto", "none", "hermes")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def tool_parser(name: str) -> str:
    """``engine.tool_call_parser`` checked (ConfigError for an unknown one); ``auto`` is resolved at load by
    :func:`resolve_parser`."""
    if name not in PARSERS:
        raise ConfigError(f"engine.tool_call_parser must be one of {', '.join(PARSERS)}, not {name!r}")
    return name


def resolve_parser(name: str, chat_template: Any) -> str | None:
    """The parser an engine uses (None: none); ``auto`` reads the convention off the model's chat template."""
    if name == "auto":
        templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
        return "hermes" if any(isinstance(t, str) and _OPEN in t for t in templates) else None
    return None if name == "none" else name


def request_tools(body: dict) -> tuple[list | None, bool]:
    """``(tools to render into the prompt, whether to parse calls)`` for a chat body, by its ``tool_choice``.

    ``none`` renders no tools (the model is not offered any, so it writes none); a named function renders only that
    one; ``auto`` and ``required`` render them all. ``required`` is not enforced by constrained decoding: the model
    is asked, and what it writes is parsed."""
    tools = body.get("tools")
    if not tools:
        return None, False
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "required"):
        return tools, True
    if choice == "none":
        return None, False
    name = ((choice.get("function") or {}).get("name") if isinstance(choice, dict)
            and choice.get("type") == "function" else None)
    if not isinstance(name, str):
        raise ValidationFailed("tool_choice must be 'auto', 'none', 'required' or {type: function, function: {name}}",
                               param="tool_choice")
    named = [t for t in tools if isinstance(t.get("function"), dict) and t["function"].get("name") == name]
    if not named:
        raise ValidationFailed(f"tool_choice names {name!r}, which is not among tools", param="tool_choice")
    return named, True


def finish_reason(reason: str, calls: list) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the answer ended on its own after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason


def _call(block: str) -> dict | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


class ToolCallStream:
    """Splits generated text into ``("text", str)`` and ``("call", OpenAI tool call)`` events as it arrives.

    Text that could still become a call (a partial ``<tool_call>`` tag, an open block) and whitespace that may end up
    next to a call are held back until they are decided; :meth:`finish` releases the rest."""

    def __init__(self, parser: str | None):
        self.parser = parser
        self.calls: list[dict] = []
        self._buf = ""  # undecided text: a possible tag prefix, or an open block's body
        self._inside = False
        self._space = ""  # whitespace outside calls, released once non-space text follows
        self._after_call = False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.parser is None:
            return [("text", text)] if text else []
        self._buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self._inside:
                end = self._buf.find(_CLOSE)
                if end < 0:
                    return out
                block, self._buf, self._inside = self._buf[:end], self._buf[end + len(_CLOSE):], False
                call = _call(block.strip())
                if call is None:
                    out += self._text(_OPEN + block + _CLOSE)
                else:
                    self._space, self._after_call = "", True
                    self.calls.append(call)
                    out.append(("call", call))
                continue
            start = self._buf.find(_OPEN)
            if start >= 0:
                out += self._text(self._buf[:start])
                self._buf, self._inside = self._buf[start + len(_OPEN):], True
                continue
            keep = next((k for k in range(min(len(_OPEN) - 1, len(self._buf)), 0, -1)
                         if self._buf.endswith(_OPEN[:k])), 0)
            cut = len(self._buf) - keep
            out += self._text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return out

    def finish(self) -> list[tuple[str, Any]]:
        """Release what is held: an unclosed block and a trailing tag prefix are text; whitespace after a call is
        dropped."""
        if self.parser is None:
            return []
        rest = (_OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        out = self._text(rest)
        if self._space and not self._after_call:
            out.append(("text", self._space))
        self._space = ""
        return out

    def _text(self, text: str) -> list[tuple[str, Any]]:
        text = self._space + text
        if not text.strip():
            self._space = text
            return []
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._space, self._after_call = text[len(body):], False
        return [("text", body)]


def parse_tool_calls(parser: str | None, text: str) -> tuple[str, list[dict]]:
    """``(content without the calls, OpenAI tool_calls)``; no calls leaves the text unchanged."""
    stream = ToolCallStream(parser if parser != "none" else None)
    events = stream.feed(text) + stream.finish()
    if not stream.calls:
        return text, []
    return "".join(value for kind, value in events if kind == "text"), stream.calls
