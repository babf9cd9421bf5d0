"""The body schemas of both dialects (reef_core.serve.schema) and the depth-limited JSON parse, without a server.

Every single-field mutation of a full-featured body (each field replaced by each wrong-typed value) is either
refused with a ValidationFailed naming a field, or translated to the other dialect without any other exception:
what the schema lets through, translation can use.
"""

from __future__ import annotations

import copy
import json

import pytest

from reef_core.engines.translate import translate_request
from reef_core.errors import ValidationFailed
from reef_core.serve.routes.jsonbody import MAX_DEPTH, parse_json_object
from reef_core.serve.schema import validate_request

ANTHROPIC = {
    "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "s"}],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image", "source": {"type": "url", "url": "http://x"}},
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
    "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "auto"}, "stop_sequences": ["x"],
    "metadata": {"user_id": "u"}, "temperature": 0.5, "top_p": 0.5, "top_k": 3, "stream": False,
}
OPENAI = {
    "model": "m", "max_tokens": 8, "seed": 1, "n": 1,
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "image_url", "image_url": {"url": "http://x"}}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "r"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto",
    "stop": ["x"], "temperature": 0.5, "user": "u", "response_format": {"type": "text"},
}
WRONG = [5, "x", None, [], {}, ["x"], [5], [{}], [[]], True, 2**70, -1, 1.5, {"type": 5}]
CASES = [("anthropic", "messages", ANTHROPIC, "openai"), ("anthropic", "count_tokens", ANTHROPIC, "openai"),
         ("openai", "chat", OPENAI, "anthropic")]


def _paths(value, path=()):
    if path:
        yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*path, key))


def _mutated(body: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize("dialect,route,body,other", CASES, ids=[f"{d}-{r}" for d, r, _, _ in CASES])
def test_what_the_schema_accepts_translates(dialect, route, body, other):
    validate_request(dialect, route, body)
    translate_request(body, dialect, other)
    refused = 0
    for path in _paths(body):
        for value in WRONG:
            candidate = _mutated(body, path, value)
            try:
                validate_request(dialect, route, candidate)
            except ValidationFailed as exc:
                assert exc.param and exc.message.startswith(exc.param), exc.message
                refused += 1
                continue
            try:
                translate_request(candidate, dialect, other)
            except ValidationFailed:
                pass  # an untranslatable but well-typed request: a 400 as well
    assert refused > 100


@pytest.mark.parametrize("dialect,route,bad,param", [
    ("anthropic", "messages", {"max_tokens": "abc"}, "max_tokens"),
    ("anthropic", "messages", {"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ("anthropic", "messages", {"temperature": 1.5}, "temperature"),
    ("anthropic", "count_tokens", {"tools": "x"}, "tools"),
    ("openai", "chat", {"seed": 2**63}, "seed"),
    ("openai", "chat", {"n": 0}, "n"),
    ("openai", "chat", {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("openai", "chat", {"tool_choice": ["auto"]}, "tool_choice"),
    ("openai", "chat", {"messages": []}, "messages"),
])
def test_violations_name_the_field(dialect, route, bad, param):
    base = ANTHROPIC if dialect == "anthropic" else OPENAI
    with pytest.raises(ValidationFailed) as caught:
        validate_request(dialect, route, {**base, **bad})
    assert caught.value.param == param


def test_unknown_fields_pass_through():
    validate_request("openai", "chat", {**OPENAI, "reasoning_effort": "low", "x_vendor": {"a": [1]}})
    validate_request("anthropic", "messages", {**ANTHROPIC, "container": "c", "service_tier": "auto"})


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1_000, 200_000])
def test_deep_nesting_is_refused_without_recursion(depth):
    with pytest.raises(ValidationFailed, match="nested deeper"):
        parse_json_object(('{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}").encode())


def test_nesting_up_to_the_limit_parses():
    raw = '{"a": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}"
    assert parse_json_object(raw.encode()) == json.loads(raw)


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": -Infinity}', b"[1]", b"{", b"\xff"])
def test_not_a_json_object_is_refused(raw):
    with pytest.raises(ValidationFailed):
        parse_json_object(raw)
