"""Turning JSONL lines into record-import envelopes for ``POST /reef/records/batch`` (``reef import``,
:meth:`ReefClient.import_records`).

A line is either Reef's own envelope ``{"agent_record_id", "request_type", "payload"}``, sent as it is, or an
OpenAI-style conversation ``{"messages": [..., {"role": "assistant", ...}], "score"?, "feedback"?, "metadata"?,
"model"?, "tools"?}``: its last message, the assistant's, becomes the response of an inference record of the
messages before it, and a ``score`` or ``feedback`` adds a report quoting it. The ids of a conversation's records
derive from its content and the scenario (record ids are unique across scenarios), so importing the same file into
the same scenario twice stores each record once (the server answers an identical retry with the stored receipt).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

ENVELOPE_FIELDS = frozenset({"agent_record_id", "request_type", "payload"})
CONVERSATION_FIELDS = frozenset({"messages", "score", "feedback", "metadata", "model", "tools"})
#: Envelopes per request: the server takes 1 to 1,000.
DEFAULT_BATCH = 500


def conversation_envelopes(line: dict, scenario: str, where: str = "line") -> list[dict]:
    """The envelopes of an OpenAI-style conversation line (an inference record, then a report when scored)."""
    unknown = sorted(set(line) - CONVERSATION_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; a conversation line has "
                         f"{', '.join(sorted(CONVERSATION_FIELDS))}")
    messages = line["messages"]
    if not isinstance(messages, list) or len(messages) < 2 or not isinstance(messages[-1], dict) \
            or messages[-1].get("role") != "assistant":
        raise ValueError(f"{where}: messages must end with the assistant's reply after at least one message")
    identity = json.dumps([scenario, line], sort_keys=True, ensure_ascii=False)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    inference_id = f"imp-{digest}"
    request: dict[str, Any] = {"model": line.get("model") or "imported", "messages": messages[:-1]}
    if line.get("tools") is not None:
        request["tools"] = line["tools"]
    reply = messages[-1]
    payload = {**request, "response": {"object": "chat.completion", "model": request["model"], "choices": [
        {"index": 0, "message": reply, "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop"}]}}
    envelopes = [{"agent_record_id": inference_id, "request_type": "inference", "payload": payload}]
    report = {k: line[k] for k in ("score", "feedback", "metadata") if line.get(k) is not None}
    if "score" in report or "feedback" in report:
        envelopes.append({"agent_record_id": f"{inference_id}-report", "request_type": "report",
                          "payload": {**report, "references": [inference_id]}})
    return envelopes


def line_envelopes(line: Any, scenario: str, where: str = "line") -> list[dict]:
    """The envelopes one parsed JSONL line stands for; ``ValueError`` naming ``where`` for anything else."""
    if not isinstance(line, dict):
        raise ValueError(f"{where}: not a JSON object")
    if "request_type" in line or "agent_record_id" in line:
        return [line]
    if "messages" in line:
        return conversation_envelopes(line, scenario, where)
    raise ValueError(f"{where}: neither a Reef envelope (agent_record_id, request_type, payload) nor a "
                     "conversation ({\"messages\": [...], \"score\": ...})")


def read_jsonl(lines: Iterable[str], scenario: str, name: str = "input") -> Iterator[tuple[int, list[dict]]]:
    """``(line number, envelopes)`` for each non-blank line; ``ValueError`` naming ``name:line`` on a bad one."""
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{name}:{number}: not JSON ({exc})") from None
        yield number, line_envelopes(parsed, scenario, f"{name}:{number}")


def batches(items: Iterable[dict | list[dict]], size: int = DEFAULT_BATCH) -> Iterator[list[dict]]:
    """Group envelopes into requests of at most ``size``; a group given as a list (a conversation and its report)
    stays in one request, so a report travels with the inference record it quotes."""
    if not 1 <= size <= 1000:
        raise ValueError("batch size must be from 1 to 1000")
    current: list[dict] = []
    for item in items:
        group = item if isinstance(item, list) else [item]
        if current and len(current) + len(group) > size:
            yield current
            current = []
        current.extend(group)
    if current:
        yield current
