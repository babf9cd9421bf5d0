"""Tool calls read from generated text (``engine.tool_call_parser``): the streaming splitter agrees with the
whole-text parse wherever the text is cut, holds back only what could still become a call, and leaves malformed
blocks as content."""

from __future__ import annotations

import json

import pytest

from reef_core.engines.toolcalls import ToolCallStream, parse_tool_calls, request_tools, resolve_parser
from reef_core.errors import ValidationFailed

TEXT = ('Let me look. <tool_call>\n{"name": "search", "arguments": {"q": "reef"}}\n</tool_call>\n'
        '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>\n')


def split(text: str, size: int) -> tuple[list, ToolCallStream]:
    stream = ToolCallStream("hermes")
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i:i + size])
    return events + stream.finish(), stream


@pytest.mark.parametrize("size", [1, 2, 5, 13, len(TEXT)])
def test_streamed_split_matches_the_whole_text_parse(size):
    content, calls = parse_tool_calls("hermes", TEXT)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("search", {"q": "reef"}), ("echo", {"text": "hi"})]
    events, stream = split(TEXT, size)
    assert "".join(v for k, v in events if k == "text") == content
    assert [v["function"] for k, v in events if k == "call"] == [c["function"] for c in calls]
    assert stream.calls[0]["id"].startswith("call_") and stream.calls[0]["type"] == "function"


def test_text_is_released_before_the_call_closes_and_a_tag_prefix_is_held():
    stream = ToolCallStream("hermes")
    assert stream.feed("Checking <tool") == [("text", "Checking")]
    assert stream.feed('_call>{"name": "x", "argu') == []  # inside an open block: nothing decided yet
    kind, call = stream.feed('ments": {}}</tool_call>')[0]
    assert kind == "call" and call["function"] == {"name": "x", "arguments": "{}"}


@pytest.mark.parametrize("text", ["<tool_call>not json</tool_call>", "<tool_call>[1, 2]</tool_call>",
                                  'partial <tool_call>{"name": "x"', "a < b <tool", "  plain text \n"])
def test_malformed_or_unclosed_blocks_stay_content(text):
    assert parse_tool_calls("hermes", text) == (text, [])
    events, stream = split(text, 3)
    assert "".join(v for _, v in events) == text and not stream.calls


def test_no_parser_passes_text_through():
    assert parse_tool_calls(None, TEXT) == (TEXT, [])
    assert parse_tool_calls("none", TEXT) == (TEXT, [])
    assert ToolCallStream(None).feed("<tool_call>") == [("text", "<tool_call>")]


def test_auto_follows_the_chat_template():
    assert resolve_parser("auto", "{{ '<tool_call>' }}") == "hermes"
    assert resolve_parser("auto", {"default": "x", "tool_use": "<tool_call>"}) == "hermes"
    assert resolve_parser("auto", "{{ messages }}") is None and resolve_parser("auto", None) is None
    assert resolve_parser("none", "<tool_call>") is None and resolve_parser("hermes", None) == "hermes"


TOOLS = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]


def test_tool_choice_decides_what_is_offered_and_parsed():
    assert request_tools({"tools": TOOLS}) == (TOOLS, True)
    assert request_tools({"tools": TOOLS, "tool_choice": "required"}) == (TOOLS, True)
    assert request_tools({"tools": TOOLS, "tool_choice": "none"}) == (None, False)
    assert request_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "b"}}}) == (
        TOOLS[1:], True)
    assert request_tools({}) == (None, False)
    for choice in ({"type": "function", "function": {"name": "c"}}, {"type": "x"}, "sometimes"):
        with pytest.raises(ValidationFailed) as info:
            request_tools({"tools": TOOLS, "tool_choice": choice})
        assert info.value.param == "tool_choice"
