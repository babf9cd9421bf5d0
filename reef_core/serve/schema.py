"""Request-body schemas of the two inference dialects, checked before a body is used.

:func:`validate_request` checks an OpenAI Chat Completions or an Anthropic Messages /
count_tokens body against its dialect's schema: types, value ranges and integer bounds of every
field Reef, its translators or its engines read. The first violation raises
:class:`ValidationFailed` whose ``param`` names the field (``messages[0].content[1]``), so the
client gets a 400 in its own dialect instead of a failure deep in translation or generation.

Fields the schemas do not know pass through untouched: providers accept extensions, and a
relay must not refuse what its provider would take. Required members follow the published APIs on
every engine: ``model`` and ``messages`` on OpenAI, ``model``, ``messages`` and ``max_tokens`` on
Anthropic Messages (``model`` and ``messages`` for count_tokens), so a client that works against Reef
also works against the provider.
"""

from __future__ import annotations

import math
from typing import Any

from reef_core.errors import ValidationFailed
from reef_core.wire import PIN_HEADER, RECORD_ID_HEADER, SCENARIO_HEADER, TAG_PREFIX

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_ANTHROPIC_ROLES = frozenset({"user", "assistant"})
_OPENAI_TOOL_CHOICES = frozenset({"none", "auto", "required"})


def _fail(param: str, problem: str):
    raise ValidationFailed(f"{param}: {problem}", param=param)


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


# -- field checks: each returns nothing and raises on the first problem --------------------------------------

def _integer(body: dict, key: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(key, f"must be an integer, not {_kind(value)}")
    if not lo <= value <= hi:
        _fail(key, f"must be between {lo} and {hi}")


def _number(body: dict, key: str, lo: float, hi: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(key, f"must be a number, not {_kind(value)}")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not (math.isfinite(as_float) and lo <= as_float <= hi):
        _fail(key, f"must be a number between {lo:g} and {hi:g}")


def _typed(body: dict, key: str, kind: type, name: str) -> None:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        _fail(key, f"must be {name}, not {_kind(value)}")


def _string_list(value: Any, param: str, allow_string: bool) -> None:
    if value is None or (allow_string and isinstance(value, str)):
        return
    if not isinstance(value, list):
        _fail(param, "must be a string or an array of strings" if allow_string else "must be an array of strings")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            _fail(f"{param}[{i}]", f"must be a string, not {_kind(item)}")


def _parts(content: Any, param: str, what: str) -> None:
    """Content: a string, or an array of objects each with a string ``type``."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        _fail(param, f"must be a string or an array of {what}, not {_kind(content)}")
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            _fail(where, f"must be an object, not {_kind(part)}")
        if not isinstance(part.get("type"), str):
            _fail(f"{where}.type", "must be a string")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            _fail(f"{where}.text", "must be a string")
        if part["type"] == "image_url" and not (isinstance(part.get("image_url"), dict)
                                                and isinstance(part["image_url"].get("url"), str)):
            _fail(f"{where}.image_url.url", "must be a string")
        if part["type"] == "image" and not (isinstance(part.get("source"), dict)
                                            and isinstance(part["source"].get("type"), str)):
            _fail(f"{where}.source.type", "must be a string")


def _messages(body: dict, roles: frozenset, each) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        _fail("messages", f"must be an array of messages, not {_kind(messages)}")
    if not messages:
        _fail("messages", "must contain at least one message")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            _fail(where, f"must be an object, not {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in roles:
            _fail(f"{where}.role", f"must be one of {', '.join(sorted(roles))}")
        each(message, where)


def _object_list(body: dict, key: str) -> list:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        _fail(key, f"must be an array, not {_kind(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            _fail(f"{key}[{i}]", f"must be an object, not {_kind(item)}")
    return value


# -- OpenAI Chat Completions ---------------------------------------------------------------------------------

def _openai_message(message: dict, where: str) -> None:
    content = message.get("content")
    if content is not None:
        _parts(content, f"{where}.content", "content parts")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            _fail(f"{where}.{key}", "must be a string")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        _fail(f"{where}.tool_calls", f"must be an array, not {_kind(calls)}")
    for k, call in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            _fail(f"{at}.function", "must be an object")
        fn = call["function"]
        if not isinstance(fn.get("name"), str):
            _fail(f"{at}.function.name", "must be a string")
        if fn.get("arguments") is not None and not isinstance(fn["arguments"], str):
            _fail(f"{at}.function.arguments", "must be a string of JSON")


def _required(body: dict, *keys: str) -> None:
    """The dialect's required members, whatever the engine serves (a strict provider refuses a body without)."""
    for key in keys:
        if body.get(key) is None:
            _fail(key, "is required")


def validate_openai_chat(body: dict) -> None:
    _required(body, "model")
    _typed(body, "model", str, "a string")
    _messages(body, _OPENAI_ROLES, _openai_message)
    for key in ("max_tokens", "max_completion_tokens"):
        _integer(body, key, 1)
    _integer(body, "n", 1, 128)
    _integer(body, "seed")
    _integer(body, "top_logprobs", 0, 20)
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    for key in ("presence_penalty", "frequency_penalty"):
        _number(body, key, -2, 2)
    for key in ("stream", "logprobs", "parallel_tool_calls", "store"):
        _typed(body, key, bool, "a boolean")
    for key in ("stream_options", "response_format", "logit_bias", "metadata", "audio"):
        _typed(body, key, dict, "an object")
    _typed(body, "user", str, "a string")
    _string_list(body.get("stop"), "stop", allow_string=True)
    _string_list(body.get("modalities"), "modalities", allow_string=False)
    for j, tool in enumerate(_object_list(body, "tools")):
        if not isinstance(tool.get("type"), str):
            _fail(f"tools[{j}].type", "must be a string")
        if tool["type"] == "function":
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                _fail(f"tools[{j}].function.name", "must be a string")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                _fail(f"tools[{j}].function.parameters", "must be an object")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, str) and choice in _OPENAI_TOOL_CHOICES
                                   or isinstance(choice, dict)):
        _fail("tool_choice", "must be 'none', 'auto', 'required' or an object")


# -- POST /reef/scenarios/{s}/evaluate ------------------------------------------------------------------------

#: What an evaluate body may hold (``model`` is accepted for OpenAI-shaped callers and ignored).
EVALUATE_FIELDS = ("release", "messages", "max_tokens", "temperature", "seed", "model")
#: Roles the private engine answers (no tool turns: it is given no tools).
_EVALUATE_ROLES = frozenset({"system", "user", "assistant"})
#: The longest reply an evaluate call may ask for.
EVALUATE_MAX_TOKENS = 4096


def _evaluate_message(message: dict, where: str) -> None:
    content = message.get("content")
    if isinstance(content, list):
        _parts(content, f"{where}.content", "text parts")
        for j, part in enumerate(content):
            if part["type"] != "text":
                _fail(f"{where}.content[{j}].type", "must be 'text' (the private engine reads text only)")
    elif not isinstance(content, str):
        _fail(f"{where}.content", f"must be a string or an array of text parts, not {_kind(content)}")
    unknown = sorted(set(message) - {"role", "content", "name"})
    if unknown:
        _fail(f"{where}.{unknown[0]}", "unknown member (a message takes role, content and name)")
    _typed(message, "name", str, "a string")


def validate_evaluate(body: dict) -> None:
    """An evaluate body (:data:`EVALUATE_FIELDS`): the first problem is a 400 naming its field."""
    unknown = sorted(set(body) - set(EVALUATE_FIELDS))
    if unknown:
        _fail(unknown[0], f"unknown field (an evaluate body takes {', '.join(EVALUATE_FIELDS)})")
    release = body.get("release")
    if not isinstance(release, str) or not release.strip() or len(release) > 200:
        _fail("release", "a release id, an alias name or 'candidate' (1 to 200 characters) is required")
    _messages(body, _EVALUATE_ROLES, _evaluate_message)
    _integer(body, "max_tokens", 1, EVALUATE_MAX_TOKENS)
    _number(body, "temperature", 0, 2)
    _integer(body, "seed")
    _typed(body, "model", str, "a string")


# -- Anthropic Messages and count_tokens ---------------------------------------------------------------------

def _anthropic_message(message: dict, where: str) -> None:
    content = message.get("content")
    if content is None:
        _fail(f"{where}.content", "is required")
    _parts(content, f"{where}.content", "content blocks")
    for j, block in enumerate(content if isinstance(content, list) else ()):
        at = f"{where}.content[{j}]"
        if block["type"] == "tool_result" and block.get("content") is not None:
            _parts(block["content"], f"{at}.content", "content blocks")
        if block["type"] == "tool_use" and block.get("input") is not None and not isinstance(block["input"], dict):
            _fail(f"{at}.input", "must be an object")


def validate_anthropic_messages(body: dict) -> None:
    _required(body, "model", "max_tokens")
    _anthropic_body(body)


def validate_anthropic_count_tokens(body: dict) -> None:
    _required(body, "model")  # counting takes no max_tokens
    _anthropic_body(body)


def _anthropic_body(body: dict) -> None:
    _typed(body, "model", str, "a string")
    _messages(body, _ANTHROPIC_ROLES, _anthropic_message)
    system = body.get("system")
    if system is not None:
        _parts(system, "system", "text blocks")
    for j, tool in enumerate(_object_list(body, "tools")):
        if not isinstance(tool.get("name"), str):
            _fail(f"tools[{j}].name", "must be a string")
        if tool.get("input_schema") is not None and not isinstance(tool["input_schema"], dict):
            _fail(f"tools[{j}].input_schema", "must be an object")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
            _fail("tool_choice", "must be an object with a string type")
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            _fail("tool_choice.name", "must be a string")
    _typed(body, "thinking", dict, "an object")
    _integer(body, "max_tokens", 1)
    _integer(body, "top_k", 0)
    _number(body, "temperature", 0, 1)
    _number(body, "top_p", 0, 1)
    _typed(body, "stream", bool, "a boolean")
    _string_list(body.get("stop_sequences"), "stop_sequences", allow_string=False)
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            _fail("metadata", f"must be an object, not {_kind(metadata)}")
        if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
            _fail("metadata.user_id", "must be a string")


_VALIDATORS = {
    ("openai", "chat"): validate_openai_chat,
    ("anthropic", "messages"): validate_anthropic_messages,
    # count_tokens bodies go through the same translation, so every field it reads is checked alike.
    ("anthropic", "count_tokens"): validate_anthropic_count_tokens,
}


def validate_request(dialect: str, route: str, body: dict) -> None:
    """Check an inference body of ``dialect``'s ``route``; raise :class:`ValidationFailed` naming the field."""
    _VALIDATORS[(dialect, route)](body)


# -- the OpenAPI document: request bodies and headers ------------------------------------------------------------
#
# Inference routes are served by a fast path that reads the raw body, and the Reef routes read theirs with
# ``read_json_body``, so FastAPI sees no body parameter to document. :func:`install_openapi` adds each body's JSON
# schema (as the door above checks it: the members Reef reads, their types and ranges; unknown members pass where the
# door lets them) and the headers each route reads, so a client generator or a fuzzer (schemathesis) sees them.

def _json(schema: dict, required: bool = True) -> dict:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _form(properties: dict, required: list[str], body_required: bool = True) -> dict:
    return {"required": body_required, "content": {"application/x-www-form-urlencoded": {"schema": {
        "type": "object", "required": required, "properties": properties}}}}


#: The dashboard's per-session form token: required of a POST signed in by cookie, not of one with a token header.
_CSRF = {"csrf": {"type": "string", "description": "the form token of a cookie-signed-in dashboard session"}}


def _header(name: str, description: str, required: bool = False) -> dict:
    return {"name": name, "in": "header", "required": required, "description": description,
            "schema": {"type": "string", "minLength": 1 if required else 0}}


_STRING_OR_PARTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}, {"type": "null"}]}
_CHAT = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": {"type": "string", "minLength": 1},
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": sorted(_OPENAI_ROLES)}, "content": {"oneOf": [*_STRING_OR_PARTS["oneOf"], {"type": "null"}]},
        "name": {"type": "string"}, "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}}}}},
    "max_tokens": {"type": "integer", "minimum": 1}, "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number", "minimum": 0,
                                                                              "maximum": 1},
    "n": {"type": "integer", "minimum": 1}, "seed": {"type": "integer"}, "stop": _STOP,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "stream": {"type": "boolean"}, "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": "boolean"}}},
    "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}}}},
    "tool_choice": {"oneOf": [{"enum": sorted(_OPENAI_TOOL_CHOICES)}, {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean"}, "user": {"type": "string"}}}
_ANTHROPIC_MESSAGES = {"type": "array", "items": {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": sorted(_ANTHROPIC_ROLES)}, "content": _STRING_OR_PARTS}}}
_ANTHROPIC_TOOLS = {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "description": {"type": "string"}, "input_schema": {"type": "object"}}}}
_COUNT_TOKENS = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": {"type": "string", "minLength": 1}, "messages": _ANTHROPIC_MESSAGES, "system": _STRING_OR_PARTS,
    "tools": _ANTHROPIC_TOOLS, "tool_choice": {"type": "object"}}}
_MESSAGES = {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
    **_COUNT_TOKENS["properties"], "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1}, "top_p": {"type": "number", "minimum": 0,
                                                                              "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0}, "stream": {"type": "boolean"},
    "stop_sequences": {"type": "array", "items": {"type": "string"}}, "thinking": {"type": "object"},
    "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}}}}
_RESPONSE_ITEM = {"type": "object", "properties": {
    "type": {"enum": ["message", "function_call", "function_call_output"]},
    "role": {"enum": ["user", "assistant", "system", "developer"]}, "content": _STRING_OR_PARTS,
    "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"},
    "output": {"type": "string"}}}
_RESPONSES = {"type": "object", "required": ["model", "input"], "properties": {
    "model": {"type": "string", "minLength": 1},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _RESPONSE_ITEM}]},
    "instructions": {"type": "string"}, "previous_response_id": {"type": "string"}, "store": {"type": "boolean"},
    "stream": {"type": "boolean"}, "metadata": {"type": "object"}, "parallel_tool_calls": {"type": "boolean"},
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number", "minimum": 0,
                                                                              "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "safety_identifier": {"type": "string", "maxLength": 64}, "prompt_cache_key": {"type": "string", "maxLength": 64},
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}},
    "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, {"type": "object", "required": ["type", "name"],
                                                                       "properties": {"type": {"const": "function"},
                                                                                      "name": {"type": "string"}}}]}}}
_REPORT = {"type": "object", "additionalProperties": False, "properties": {
    "score": {"type": ["number", "null"], "description": "null with metadata.unscored: true for an unscored run"},
    "feedback": {"oneOf": [{"type": "string"}, {"type": "object"}]},
    "references": {"type": "array", "items": {"type": "string"}, "description": "receipts the report is about"},
    "metadata": {"type": "object"}, "agent_record_id": {"type": "string", "description": "client-chosen receipt"}}}
_ENVELOPE = {"type": "object", "required": ["agent_record_id", "request_type", "payload"],
             "additionalProperties": False, "properties": {
                 "agent_record_id": {"type": "string"}, "request_type": {"enum": ["inference", "report"]},
                 "payload": {"type": "object"}}}
_RELEASE = {"type": "object", "required": ["release_id"], "additionalProperties": False,
            "properties": {"release_id": {"type": "string", "minLength": 1}}}
_ALIAS_MOVE = {"type": "object", "required": ["release", "reason"], "additionalProperties": False, "properties": {
    "release": {"type": "string", "minLength": 1, "maxLength": 200, "description": "a release id of the scenario"},
    "reason": {"type": "string", "minLength": 1, "maxLength": 500, "description": "why (kept in the audit)"}}}
_CANARY_DECISION = {"type": "object", "required": ["action", "reason"], "additionalProperties": False, "properties": {
    "action": {"enum": ["promote", "rollback"], "description": "promote the canary, or roll it back"},
    "reason": {"type": "string", "minLength": 1, "maxLength": 500, "description": "why (kept in the release)"}}}

_EVALUATE = {"type": "object", "required": ["release", "messages"], "additionalProperties": False, "properties": {
    "release": {"type": "string", "minLength": 1, "maxLength": 200,
                "description": "a release id, an alias (production, staging...) or 'candidate' (held for review)"},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
            "role": {"enum": sorted(_EVALUATE_ROLES)}, "name": {"type": "string"},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": EVALUATE_MAX_TOKENS},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "seed": {"type": "integer"},
    "model": {"type": "string", "description": "ignored (OpenAI-shaped callers send one)"}}}

_SCENARIO = _header(SCENARIO_HEADER, "the scenario the request belongs to", required=True)
_INFERENCE_HEADERS = [
    _SCENARIO,
    _header(RECORD_ID_HEADER, "a client-chosen receipt (a retry with it answers the stored exchange)"),
    _header("Idempotency-Key", "a retry with the same key answers the stored exchange"),
    *[_header(f"{TAG_PREFIX}{name}", f"stored as the record's tag {name!r}; any x-reef-tag-<name> header is, "
              "up to 32 of them; a rollout keeps one session (or evaluation.rollout.sticky tag) on one release") for
      name in ("session", "user", "client", "trial")],
    _header(PIN_HEADER, "an alias or release id to serve this request instead of the head (admin or pin scope; "
            "harness surfaces only)")]

#: ``(method, path) -> (request body or None, header parameters)`` added to the generated document.
OPENAPI_ADDITIONS: dict[tuple[str, str], tuple[dict | None, list[dict]]] = {
    ("post", "/v1/chat/completions"): (_json(_CHAT), _INFERENCE_HEADERS),
    ("post", "/v1/messages"): (_json(_MESSAGES), _INFERENCE_HEADERS),
    ("post", "/v1/messages/count_tokens"): (_json(_COUNT_TOKENS), _INFERENCE_HEADERS),
    ("post", "/v1/responses"): (_json(_RESPONSES), _INFERENCE_HEADERS),
    ("post", "/reef/report"): (_json(_REPORT), [_SCENARIO]),
    ("post", "/reef/records"): (_json(_ENVELOPE), [_SCENARIO]),
    ("post", "/reef/records/batch"): (_json({"type": "object", "required": ["records"], "additionalProperties": False,
                                             "properties": {"records": {"type": "array", "minItems": 1,
                                                                        "maxItems": 1000, "items": _ENVELOPE}}}),
                                      [_SCENARIO]),
    ("post", "/reef/scenarios/{scenario}/rollback"): (_json(_RELEASE), []),
    ("post", "/reef/scenarios/{scenario}/promote"): (_json(_RELEASE), []),
    ("put", "/reef/scenarios/{scenario}/aliases/{name}"): (_json(_ALIAS_MOVE), []),
    ("post", "/reef/scenarios/{scenario}/canary"): (_json(_CANARY_DECISION), []),
    ("post", "/reef/scenarios/{scenario}/evaluate"): (_json(_EVALUATE), []),
    ("post", "/reef/scenarios/{scenario}/skills/close-day"): (
        _json({"type": "object", "maxProperties": 0, "description": "no fields"}, required=False), []),
    ("post", "/ui/login"): (_form({"token": {"type": "string"}}, ["token"]), []),
    ("post", "/ui/logout"): (_form(_CSRF, [], body_required=False), []),
    ("post", "/ui/scenarios/{scenario}/rollback"): (
        _form({"release_id": {"type": "string"}, "confirm": {"const": "yes"}, **_CSRF}, ["release_id", "confirm"]),
        []),
    ("post", "/ui/scenarios/{scenario}/promote"): (
        _form({"release_id": {"type": "string"}, "confirm": {"const": "yes"}, **_CSRF}, ["release_id", "confirm"]),
        []),
    ("get", "/reef/harness"): (None, [_SCENARIO]),
    ("get", "/reef/harness/files/{path}"): (None, [_SCENARIO]),
    ("get", "/reef/harness/releases"): (None, [_SCENARIO]),
    ("get", "/reef/harness/install"): (None, [{**_SCENARIO, "required": False, "schema": {"type": "string"},
                                               "description": "the scenario (or ?scenario=; both must agree)"}]),
    ("get", "/reef/skills"): (None, [_SCENARIO]),
    ("get", "/reef/skills/{slug}"): (None, [_SCENARIO]),
}


def complete_openapi(doc: dict) -> dict:
    """Add the request bodies and headers of :data:`OPENAPI_ADDITIONS` to a generated OpenAPI document (in place;
    a body or header the route already declares is kept)."""
    for (method, path), (body, headers) in OPENAPI_ADDITIONS.items():
        op = doc.get("paths", {}).get(path, {}).get(method)
        if op is None:
            continue  # a route this deployment does not mount
        if body is not None:
            op.setdefault("requestBody", body)
        params = op.setdefault("parameters", [])
        have = {(p.get("name", "").lower(), p.get("in")) for p in params}
        params.extend(dict(h) for h in headers if (h["name"].lower(), "header") not in have)
    return doc


def install_openapi(app) -> None:
    """Make ``app.openapi()`` (``/openapi.json``, ``GET /docs``) return the completed document."""
    generate = app.openapi

    def openapi() -> dict:
        if getattr(app, "reef_openapi_done", False):
            return app.openapi_schema
        doc = complete_openapi(generate())
        app.openapi_schema, app.reef_openapi_done = doc, True
        return doc

    app.openapi = openapi
