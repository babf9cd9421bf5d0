"""Tool calls parsed from a generated text, for engines that generate from token ids (``engine.tool_call_parser``).

An engine that renders the chat template itself (``engine.kind=sglang`` or ``vllm`` on a training scenario) gets plain
text back; the model writes its tool calls in its own format. Parsers:

* ``none``: never parse (the text is the answer);
* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2/2.5/3 templates);
  the text outside the blocks stays the message content.

A block that is not valid JSON with a string ``name`` is left in the content: a malformed call is the model's answer,
not an engine failure.
"""

from __future__ import annotations

import json
import re
import uuid

from ..errors import ConfigError

PARSERS = ("none", "hermes")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def tool_parser(name: str) -> str | None:
    """The parser ``engine.tool_call_parser`` names (None for ``none``); ConfigError for an unknown one."""
    if name not in PARSERS:
        raise ConfigError(f"engine.tool_call_parser must be one of {', '.join(PARSERS)}, not {name!r}")
    return None if name == "none" else name


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[dict]]:
    """``(content without the calls, OpenAI tool_calls)``; no calls leaves the text unchanged."""
    if parser != "hermes":
        return text, []
    calls, kept, last = [], [], 0
    for match in _HERMES.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    kept.append(text[last:])
    return "".join(kept).strip(), calls
