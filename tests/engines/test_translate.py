"""Dialect translation: requests, responses, errors and streams, checked against the official SDKs' models."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from anthropic.types import Message

from reef_core.engines.base import TOKENS_EVENT, StreamEvent
from reef_core.engines.translate import (
    AnthropicToOpenAIStream,
    OpenAIToAnthropicStream,
    anthropic_to_openai_request,
    anthropic_to_openai_response,
    openai_to_anthropic_request,
    openai_to_anthropic_response,
    translate_error,
)
from reef_core.errors import UpstreamError, ValidationFailed

TOOL = {"type": "function", "function": {"name": "lookup", "description": "find a thing",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
IMG = "data:image/png;base64,iVBORw0KGgo="

OPENAI_REQ = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "use tools"}]},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": IMG}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "a"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "b"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "A"},
        {"role": "tool", "tool_call_id": "call_2", "content": "B"},
        {"role": "user", "content": "thanks"},
    ],
    "temperature": 0.5, "top_p": 0.9, "stop": "END", "stream": True, "seed": 3, "user": "u1",
    "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
}


def test_openai_request_to_anthropic_shape():
    out = openai_to_anthropic_request(OPENAI_REQ, default_max_tokens=321)
    assert out["system"] == "be brief\n\nuse tools"
    assert out["max_tokens"] == 321  # Anthropic requires it: the default fills in
    assert out["stop_sequences"] == ["END"] and out["temperature"] == 0.5 and out["top_p"] == 0.9
    assert out["stream"] is True and out["metadata"] == {"user_id": "u1"} and "seed" not in out
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]  # tool results merged
    user0 = out["messages"][0]["content"]
    assert user0[1] == {"type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    assert [b["type"] for b in out["messages"][1]["content"]] == ["tool_use", "tool_use"]
    assert out["messages"][1]["content"][1]["input"] == {"q": "b"}
    assert out["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "A"},
        {"type": "tool_result", "tool_use_id": "call_2", "content": "B"},
        {"type": "text", "text": "thanks"}]
    assert out["tools"] == [{"name": "lookup", "description": "find a thing",
                             "input_schema": TOOL["function"]["parameters"]}]
    assert out["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}


def test_request_round_trip_openai_anthropic_openai():
    back = anthropic_to_openai_request(openai_to_anthropic_request(OPENAI_REQ))
    msgs = back["messages"]
    assert msgs[0] == {"role": "system", "content": "be brief\n\nuse tools"}
    assert msgs[1]["content"][1] == {"type": "image_url", "image_url": {"url": IMG}}
    calls = msgs[2]["tool_calls"]
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in calls] == [("call_1", {"q": "a"}),
                                                                                   ("call_2", {"q": "b"})]
    assert msgs[3:] == [{"role": "tool", "tool_call_id": "call_1", "content": "A"},
                        {"role": "tool", "tool_call_id": "call_2", "content": "B"},
                        {"role": "user", "content": "thanks"}]
    assert back["tools"] == [TOOL] and back["tool_choice"] == "required" and back["parallel_tool_calls"] is False
    assert back["stop"] == ["END"] and back["temperature"] == 0.5
    assert back["stream_options"] == {"include_usage": True}


def test_request_round_trip_anthropic_openai_anthropic():
    req = {"model": "claude", "max_tokens": 99, "system": [{"type": "text", "text": "sys"}],
           "messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                          {"type": "text", "text": "let me look"},
                                                          {"type": "tool_use", "id": "t1", "name": "lookup",
                                                           "input": {"q": "x"}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                      "content": [{"type": "text", "text": "found"}]}]}],
           "stop_sequences": ["\n\n"], "top_k": 5, "tool_choice": {"type": "tool", "name": "lookup"},
           "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}
    mid = anthropic_to_openai_request(req)
    assert "top_k" not in mid and mid["max_tokens"] == 99
    assert mid["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    back = openai_to_anthropic_request(mid)
    assert back["system"] == "sys" and back["max_tokens"] == 99 and back["stop_sequences"] == ["\n\n"]
    assert back["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "let me look"},
                                          {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "found"}]}]
    assert back["tool_choice"] == {"type": "tool", "name": "lookup"}


@pytest.mark.parametrize("patch", [
    {"n": 2}, {"logprobs": True}, {"response_format": {"type": "json_schema", "json_schema": {}}},
    {"temperature": 1.5}, {"messages": [{"role": "function", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
    {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
])
def test_untranslatable_openai_requests_are_refused(patch):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(ValidationFailed):
        openai_to_anthropic_request(body)


@pytest.mark.parametrize("patch", [
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    {"messages": [{"role": "system", "content": "x"}]},
])
def test_untranslatable_anthropic_requests_are_refused(patch):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(ValidationFailed):
        anthropic_to_openai_request(body)


def test_openai_response_to_anthropic_validates_as_sdk_message():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                         "message": {"role": "assistant", "content": "checking",
                                     "tool_calls": [{"id": "call_9", "type": "function",
                                                     "function": {"name": "lookup", "arguments": '{"q": 1}'}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                      "prompt_tokens_details": {"cached_tokens": 3}}}
    out = openai_to_anthropic_response(body)
    msg = Message.model_validate(out)  # the SDK's own schema
    assert msg.stop_reason == "tool_use"
    assert msg.content[0].text == "checking" and msg.content[1].input == {"q": 1}
    assert (msg.usage.input_tokens, msg.usage.output_tokens, msg.usage.cache_read_input_tokens) == (7, 4, 3)
    back = anthropic_to_openai_response(out)
    ChatCompletion.model_validate(back)
    assert back["choices"][0]["finish_reason"] == "tool_calls"
    assert back["usage"] == body["usage"]
    assert json.loads(back["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"q": 1}


@pytest.mark.parametrize("stop,finish", [("end_turn", "stop"), ("stop_sequence", "stop"),
                                         ("max_tokens", "length"), ("tool_use", "tool_calls")])
def test_anthropic_response_to_openai(stop, finish):
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": "c",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 1,
                      "cache_creation_input_tokens": 2}}
    out = ChatCompletion.model_validate(anthropic_to_openai_response(body, created=7))
    assert out.choices[0].message.content == "ab" and out.choices[0].finish_reason == finish
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (8, 2, 10)
    assert out.id == "chatcmpl-msg_1" and out.created == 7


def test_error_bodies_keep_the_message():
    oa = {"error": {"message": "slow down", "type": "rate_limit_error"}}
    an = translate_error(oa, 429, "anthropic")
    assert an == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert translate_error(an, 429, "openai")["error"]["message"] == "slow down"


# ---- streams ------------------------------------------------------------------------------------------------

def _chunk(delta=None, finish=None, **extra):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return StreamEvent(None, {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": "m",
                              "choices": choices, **extra})


OPENAI_STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": "Hel"}),
    _chunk({"content": "lo"}),
    _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                            "function": {"name": "lookup", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"q": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}),
    _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                            "function": {"name": "lookup", "arguments": '{"q": "y"}'}}]}),
    _chunk({}, "tool_calls"),
    _chunk(None, usage={"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17}),
    StreamEvent(TOKENS_EVENT, {"prompt_ids": [1], "output_ids": [2], "output_logprobs": [-0.5], "version": "v"}),
    StreamEvent(None, "[DONE]"),
]


def _translate(tr, events):
    out = []
    for ev in events:
        out += tr.feed(ev)
    return out + tr.finish()


def test_openai_stream_to_anthropic_strict_order_and_sdk_accumulation():
    out = _translate(OpenAIToAnthropicStream(), OPENAI_STREAM)
    kinds = [(e.event, e.data.get("index")) if e.event and e.event.startswith("content") else e.event for e in out]
    assert kinds == [
        "message_start",
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        "message_delta", TOKENS_EVENT, "message_stop"]  # token data right before the terminal event
    assert all(e.data["type"] == e.event for e in out if not e.is_reef)  # event name == data type
    snap = None
    bufs: dict = {}
    for e in out:
        if not e.is_reef:
            snap = accumulate_event(event=e.data, current_snapshot=snap, json_bufs=bufs)
    assert [b.type for b in snap.content] == ["text", "tool_use", "tool_use"]
    assert snap.content[0].text == "Hello"
    assert (snap.content[1].id, snap.content[1].input) == ("call_a", {"q": "x"})
    assert snap.content[2].input == {"q": "y"}
    assert snap.stop_reason == "tool_use"
    assert (snap.usage.input_tokens, snap.usage.output_tokens) == (11, 6)


def test_openai_stream_interleaved_tool_deltas_are_refused():
    tr = OpenAIToAnthropicStream()
    for ev in OPENAI_STREAM[:7]:
        tr.feed(ev)
    with pytest.raises(UpstreamError):
        tr.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "more"}}]}))


def test_openai_stream_without_done_closes_on_finish():
    tr = OpenAIToAnthropicStream()
    out = _translate(tr, [_chunk({"content": "x"}), _chunk({}, "length")])
    assert [e.event for e in out] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop"]
    assert out[-2].data["delta"]["stop_reason"] == "max_tokens"


ANTHROPIC_STREAM = [
    StreamEvent("message_start", {"type": "message_start", "message": {
        "id": "msg_s", "type": "message", "role": "assistant", "model": "c", "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": 1}}}),
    StreamEvent("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
    StreamEvent("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
    StreamEvent("content_block_stop", {"type": "content_block_stop", "index": 0}),
    StreamEvent("content_block_start", {"type": "content_block_start", "index": 1,
                                        "content_block": {"type": "text", "text": ""}}),
    StreamEvent("ping", {"type": "ping"}),
    StreamEvent("content_block_delta", {"type": "content_block_delta", "index": 1,
                                        "delta": {"type": "text_delta", "text": "Hi "}}),
    StreamEvent("content_block_delta", {"type": "content_block_delta", "index": 1,
                                        "delta": {"type": "text_delta", "text": "there"}}),
    StreamEvent("content_block_stop", {"type": "content_block_stop", "index": 1}),
    StreamEvent("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}}),
    StreamEvent("content_block_delta", {"type": "content_block_delta", "index": 2,
                                        "delta": {"type": "input_json_delta", "partial_json": '{"q":'}}),
    StreamEvent("content_block_delta", {"type": "content_block_delta", "index": 2,
                                        "delta": {"type": "input_json_delta", "partial_json": ' "z"}'}}),
    StreamEvent("content_block_stop", {"type": "content_block_stop", "index": 2}),
    StreamEvent("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                  "usage": {"output_tokens": 7}}),
    StreamEvent("message_stop", {"type": "message_stop"}),
]


def test_anthropic_stream_to_openai_sdk_accumulation():
    out = _translate(AnthropicToOpenAIStream(include_usage=True, created=5), ANTHROPIC_STREAM)
    assert out[-1] == StreamEvent(None, "[DONE]")
    assert all(e.event is None for e in out)
    state = ChatCompletionStreamState()
    for e in out[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate(e.data))
    final = state.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == "Hi there"
    assert final.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].id == "toolu_1" and json.loads(msg.tool_calls[0].function.arguments) == {"q": "z"}
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (9, 7)
    assert out[-2].data["choices"] == []  # the usage chunk has no choices, as OpenAI sends it


def test_anthropic_stream_without_usage_and_error_event():
    out = _translate(AnthropicToOpenAIStream(), ANTHROPIC_STREAM[:9] + [ANTHROPIC_STREAM[-1]])
    assert [e.data["choices"][0]["finish_reason"] for e in out[:-1]][-1] == "stop"
    assert not any(isinstance(e.data, dict) and "usage" in e.data for e in out)
    tr = AnthropicToOpenAIStream()
    tr.feed(ANTHROPIC_STREAM[0])
    with pytest.raises(UpstreamError, match="Overloaded"):
        tr.feed(StreamEvent("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))


def test_stream_round_trip_preserves_text():
    source = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "ab"}), _chunk({"content": "c"}),
              _chunk({}, "stop"), StreamEvent(None, "[DONE]")]
    a = _translate(OpenAIToAnthropicStream(), source)
    b = _translate(AnthropicToOpenAIStream(), a)
    text = "".join(e.data["choices"][0]["delta"].get("content") or "" for e in b[:-1])
    assert text == "abc" and b[-2].data["choices"][0]["finish_reason"] == "stop"
