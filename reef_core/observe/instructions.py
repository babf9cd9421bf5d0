"""Instructions: a person's plain-language request that a scenario train (``POST /reef/train``).

An instruction is stored as a ``train`` record (``payload``: ``text``, ``session``, ``release_id``, ``requires``,
``client``) in the scenario's record stream, so it is as durable as traffic. It is accepted only by a scenario whose
recipe trains in ``manual`` or ``hybrid`` mode (``recipe.training_mode``); ``auto`` scenarios form batches from
traffic alone. The learner never hands a ``train`` record to the processor: it keeps the instructions not yet
consumed by a commit as *pending* (listed by the scenario's status) and trains each, oldest first, as one step: a
:class:`~reef_core.observe.processor.Batch` with ``instructions`` set, holding the traffic batch that is ready, if any
(``hybrid``: traffic also trains on its own; ``manual``: only this way). An instruction is consumed whatever its step's
outcome (a failed step is committed as skipped with its error, never retried).

:func:`validate_instruction` is the door: every rule below raises ``ValidationFailed`` naming the field, before
anything is stored. The text screens refuse what must never become training input: credentials (keys, tokens,
private keys, passwords) and directive-shaped text that addresses the model's instructions rather than the task
(``ignore previous instructions``, role markers).
"""

from __future__ import annotations

import json
import re

from ..errors import ValidationFailed
from ..names import check_record_id

TRAINING_MODES = ("auto", "manual", "hybrid")
FIELDS = frozenset({"text", "session", "release_id", "requires", "client", "agent_record_id"})
MAX_TEXT = 4000
MAX_REQUIRES = 8
MAX_PROMPT = 200
MAX_NAME = 255
MAX_CLIENT_BYTES = 4096
REQUIRE_KINDS = ("permission", "env", "service")
CLIENT_FIELDS = frozenset({"platform", "arch", "release", "commands"})

_CREDENTIALS = re.compile("|".join((
    r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_\-]{16,}",  # OpenAI / Anthropic keys
    r"\bAKIA[0-9A-Z]{16}\b",  # AWS access key id
    r"\bgh[pousr]_[A-Za-z0-9]{30,}",  # GitHub tokens
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",  # Slack tokens
    r"\bAIza[0-9A-Za-z_\-]{30,}",  # Google API keys
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    r"\beyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.",  # a JWT
    r"\b(?:password|passwd|api[_-]?key|secret|access[_-]?token)\s*[:=]\s*\S{6,}",
    r"\bbearer\s+[A-Za-z0-9_\-.=]{20,}",
)), re.IGNORECASE)
_DIRECTIVES = re.compile("|".join((
    r"\b(?:ignore|disregard|forget|override)\b[^.\n]{0,40}\b(?:previous|prior|above|earlier|all|your|system)\b"
    r"[^.\n]{0,20}\b(?:instructions?|prompts?|rules|guidelines)\b",
    r"<\|im_(?:start|end)\|>|<\|(?:system|user|assistant|endoftext)\|>|\[/?INST\]|<</?SYS>>",
    r"^\s*(?:system|assistant)\s*:",
    r"\b(?:reveal|print|show|leak)\b[^.\n]{0,30}\b(?:system prompt|your instructions|hidden prompt)\b",
)), re.IGNORECASE | re.MULTILINE)


def _fail(param: str, problem: str):
    raise ValidationFailed(f"{param}: {problem}", param=param)


def check_training_mode(mode) -> str:
    if mode not in TRAINING_MODES:
        raise ValidationFailed(f"recipe.training_mode must be one of {', '.join(TRAINING_MODES)}, not {mode!r}",
                               param="training_mode")
    return mode


def check_text(text) -> str:
    """The instruction text, or ValidationFailed naming ``text``."""
    if not isinstance(text, str) or not text.strip():
        _fail("text", "must be a non-empty string")
    if len(text) > MAX_TEXT:
        _fail("text", f"is longer than {MAX_TEXT} characters")
    if "\x00" in text:
        _fail("text", "must not contain NUL")
    if _CREDENTIALS.search(text):
        _fail("text", "looks like it holds a credential (a key, token, private key or password); remove it")
    if _DIRECTIVES.search(text):
        _fail("text", "is directive-shaped (it addresses the model's instructions or carries role markers), "
                      "not a request about the task")
    return text.strip()


def _short(value, param: str, longest: int = MAX_NAME) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > longest or "\x00" in value:
        _fail(param, f"must be a string of at most {longest} characters")
    return value


def _requires(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        _fail("requires", "must be a list")
    if len(value) > MAX_REQUIRES:
        _fail("requires", f"holds at most {MAX_REQUIRES} items")
    out = []
    for i, item in enumerate(value):
        where = f"requires[{i}]"
        if not isinstance(item, dict):
            _fail(where, "must be an object")
        unknown = sorted(set(item) - {"name", "kind", "check", "prompt"})
        if unknown:
            _fail(f"{where}.{unknown[0]}", "is not a requirement field (name, kind, check, prompt)")
        if not isinstance(item.get("name"), str) or not item["name"].strip():
            _fail(f"{where}.name", "must be a non-empty string")
        _short(item["name"], f"{where}.name")
        if item.get("kind") not in REQUIRE_KINDS:
            _fail(f"{where}.kind", f"must be one of {', '.join(REQUIRE_KINDS)}")
        _short(item.get("check"), f"{where}.check", MAX_TEXT)
        if not isinstance(item.get("prompt"), str):
            _fail(f"{where}.prompt", "must be a string")
        _short(item["prompt"], f"{where}.prompt", MAX_PROMPT)
        out.append({k: item[k] for k in ("name", "kind", "check", "prompt") if item.get(k) is not None})
    return out


def _client(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail("client", "must be an object")
    unknown = sorted(set(value) - CLIENT_FIELDS)
    if unknown:
        _fail(f"client.{unknown[0]}", f"is not a client field ({', '.join(sorted(CLIENT_FIELDS))})")
    for key in ("platform", "arch", "release"):
        _short(value.get(key), f"client.{key}")
    commands = value.get("commands")
    if commands is not None and not (isinstance(commands, list) and all(isinstance(c, str) for c in commands)):
        _fail("client.commands", "must be a list of strings")
    if len(json.dumps(value)) > MAX_CLIENT_BYTES:
        _fail("client", f"is larger than {MAX_CLIENT_BYTES} bytes")
    return value


def validate_instruction(body: dict) -> tuple[dict, str | None]:
    """``(the train record's payload, the client's agent_record_id or None)`` for a ``POST /reef/train`` body."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        _fail(unknown[0], f"is not an instruction field ({', '.join(sorted(FIELDS))})")
    payload = {"text": check_text(body.get("text")),
               "session": _short(body.get("session"), "session"),
               "release_id": _short(body.get("release_id"), "release_id"),
               "requires": _requires(body.get("requires")),
               "client": _client(body.get("client"))}
    record_id = body.get("agent_record_id")
    if record_id is not None:
        check_record_id(record_id, "agent_record_id")
    return payload, record_id


def pending_entry(record) -> dict:
    """What status shows of a pending instruction."""
    return {"agent_record_id": record.record_id, "text": record.payload.get("text"),
            "session": record.payload.get("session"), "created_at": record.created_at}
