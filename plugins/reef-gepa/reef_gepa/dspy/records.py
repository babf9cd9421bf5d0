"""Reported records read back into DSPy examples.

A DSPy program's calls reach Reef as chat requests shaped by DSPy's chat adapter: each input field is a
``[[ ## name ## ]]`` section of the user message. :func:`recorded_inputs` finds the program's input
fields (by its signature) in a sample's user messages, :func:`recorded_outputs` parses the reply into its
output fields, and :func:`example_of` joins them with the report: its score and feedback, and the
labels a client may attach as ``metadata.labels`` (e.g. the expected answer a checker compares with).

An example's key is a digest of its inputs: the same question reported twice is one example (the newest
report wins), and whether it is held out for the gate depends on its inputs only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

_SECTION = re.compile(r"\[\[ ## (\w+) ## \]\]")
_RESPOND = "\n\nRespond with the corresponding output field"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def sections(text: str) -> dict[str, str]:
    """``{field: value}`` of the ``[[ ## field ## ]]`` sections of one message."""
    out: dict[str, str] = {}
    found = list(_SECTION.finditer(text))
    for i, match in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        value = text[match.end():end]
        cut = value.find(_RESPOND)
        out[match.group(1)] = (value[:cut] if cut >= 0 else value).strip()
    return out


def recorded_inputs(messages: list[dict], input_fields: list[str]) -> dict[str, str] | None:
    """The program's inputs from the last user message holding all of them; with one input field, a user
    message without sections is that field. None when the messages hold no such request."""
    users = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    for text in reversed(users):
        found = sections(text)
        if all(name in found for name in input_fields):
            return {name: found[name] for name in input_fields}
    if len(input_fields) == 1 and users and not _SECTION.search(users[-1]):
        return {input_fields[0]: users[-1].strip()}
    return None


def recorded_outputs(completion: str, output_fields: list[str]) -> dict[str, str] | None:
    found = sections(completion or "")
    if all(name in found for name in output_fields):
        return {name: found[name] for name in output_fields}
    return None


def example_key(inputs: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def held_out(key: str, fraction: float) -> bool:
    """Whether the example ``key`` is held out for the gate (a fixed fraction, chosen by digest)."""
    digest = int(hashlib.sha256(f"holdout:{key}".encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < fraction


def example_of(sample: Any, input_fields: list[str], output_fields: list[str]) -> dict | None:
    """One reported example ``{key, inputs, labels, recorded: {outputs, score, feedback}}``, or None."""
    if sample.reward is None or not math.isfinite(float(sample.reward)) or not sample.segments:
        return None
    inputs = recorded_inputs(sample.messages[:sample.segments[-1].message_index], input_fields)
    if inputs is None:
        return None
    metadata = sample.metadata if isinstance(sample.metadata, Mapping) else {}
    labels = metadata.get("labels")
    labels = {str(k): v for k, v in labels.items() if str(k) not in inputs} if isinstance(labels, Mapping) else {}
    feedback = sample.feedback
    if feedback is not None and not isinstance(feedback, str):
        feedback = json.dumps(feedback, sort_keys=True, default=str)
    return {"key": example_key(inputs), "inputs": inputs, "labels": labels,
            "recorded": {"outputs": recorded_outputs(sample.completion, output_fields),
                         "score": float(sample.reward), "feedback": feedback}}
