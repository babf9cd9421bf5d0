"""Conformance judged by an external validator (issue #36): llm-comply, pinned in the test extra.

llm-comply checks live endpoints against the providers' published specs (OpenAI Chat, Open Responses, Anthropic
Messages: the OpenAPI documents it bundles), which are stricter than the SDKs' pydantic types
(``test_dialect_conformance.py``). Two layers:

* the answers Reef builds or translates, validated directly against the bundled schemas: a translated Anthropic
  message and its streamed events, a relayed Anthropic message completed to the schema, the Responses object and
  every event of its streams (live, replayed, the error event);
* llm-comply's own suites run against ``reef serve`` on each engine kind (the fake upstream in both dialects; the
  embedded engine and the fake SGLang on the fake tool-calling model). Every check must pass, except the two a
  tiny text-only model cannot pass honestly: image input (refused with a 400 in the dialect) and calling a tool it
  was never taught (``get_weather``; ``required`` is asked for, not enforced by constrained decoding). Those may only
  fail for those reasons, never for a schema error.

Without llm-comply installed the module is skipped, except under CI (``CI`` set), where that is a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from reef_core.engines.base import StreamEvent
from reef_core.engines.translate import OpenAIToAnthropicStream, openai_to_anthropic_response, translate_response
from reef_core.serve.routes.responses import LiveStream, _event_stream, response_object

from reef_core.testing.comply import FORMATS, LLM_COMPLY_VERSION, TINY_MODEL_LIMITS, run_format, specs_dir

try:
    import llm_comply
    from llm_comply.schema import SpecLoader
except ImportError:  # pragma: no cover - the test extra pins it
    if os.environ.get("CI"):
        raise
    pytest.skip("llm-comply is not installed (pip install 'reef-core[test]')", allow_module_level=True)

SPECS = specs_dir()


def test_pinned_version():
    assert llm_comply.__version__ == LLM_COMPLY_VERSION


@pytest.fixture(scope="module")
def specs():
    return {fmt: SpecLoader(str(SPECS / name)) for fmt, name in FORMATS.items()}


def errors_of(spec: SpecLoader, data: dict, schema: str) -> list[str]:
    errors = spec.validate(data, schema)
    return [f"{schema}: {e}" for e in errors]


# ---------------------------------------------------------------------------------------------------------
# Anthropic Messages, translated from an OpenAI-dialect engine (upstream, local, vLLM, SGLang)

def completion(message: dict, finish: str, usage: dict | None = None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": usage or {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


TOOL_CALL = {"id": "call.1:x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "SF"}'}}


@pytest.mark.parametrize("message,finish", [
    ({"content": "Hello."}, "stop"),
    ({"content": None, "tool_calls": [TOOL_CALL]}, "tool_calls"),
    ({"content": "Let me look.", "tool_calls": [TOOL_CALL, {**TOOL_CALL, "id": None}]}, "tool_calls"),
    ({"content": "Hel"}, "length"),
])
def test_translated_anthropic_message_matches_the_spec(specs, message, finish):
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
             "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 1}}
    for body in (completion(message, finish), completion(message, finish, usage)):
        out = openai_to_anthropic_response(body)
        assert errors_of(specs["anthropic"], out, "Message") == []
        for block in out["content"]:
            if block["type"] == "tool_use":
                assert block["caller"] == {"type": "direct"} and re.fullmatch(r"[a-zA-Z0-9_-]+", block["id"])
    counted = openai_to_anthropic_response(completion(message, finish, usage))["usage"]
    assert counted["input_tokens"] == 5 and counted["cache_read_input_tokens"] == 4  # the real counts, not zeros
    assert counted["output_tokens_details"] == {"thinking_tokens": 1}
    assert openai_to_anthropic_response(completion(message, finish))["usage"]["output_tokens_details"] is None


ANTHROPIC_EVENTS = {"message_start": "MessageStartEvent", "content_block_start": "ContentBlockStartEvent",
                    "content_block_delta": "ContentBlockDeltaEvent", "content_block_stop": "ContentBlockStopEvent",
                    "message_delta": "MessageDeltaEvent", "message_stop": "MessageStopEvent"}


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> StreamEvent:
    data = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        data["usage"] = usage
    return StreamEvent(None, data)


@pytest.mark.parametrize("with_usage", [True, False])
def test_translated_anthropic_stream_matches_the_spec(specs, with_usage):
    stream = OpenAIToAnthropicStream()
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Let me "}), chunk({"content": "look."}),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "SF"}'}}]}),
              chunk({}, "tool_calls")]
    if with_usage:
        chunks.append(chunk(usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}))
    events = [out for ev in [*chunks, StreamEvent(None, "[DONE]")] for out in stream.feed(ev)]
    assert [e.event for e in events][0] == "message_start" and events[-1].event == "message_stop"
    for ev in events:
        assert errors_of(specs["anthropic"], ev.data, ANTHROPIC_EVENTS[ev.event]) == []
    usage = events[-2].data["usage"]
    assert usage["output_tokens"] == (4 if with_usage else 0)
    assert usage["input_tokens"] == (9 if with_usage else None)  # not counted: null, never an invented 0


def test_relayed_anthropic_message_is_completed_to_the_spec(specs):
    # What an Anthropic-dialect provider that predates the newer required members answers (the fake upstream does).
    relayed = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
               "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 2},
               "content": [{"type": "text", "text": "ok"},
                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}
    original = json.loads(json.dumps(relayed))
    out = translate_response(relayed, "anthropic", "anthropic")
    assert errors_of(specs["anthropic"], out, "Message") == []
    assert relayed == original  # copied, not changed in place (the record keeps what the provider sent)
    assert out["usage"]["input_tokens"] == 3 and out["usage"]["inference_geo"] is None
    sent = {**relayed, "container": {"id": "c1", "expires_at": "2026-01-01T00:00:00Z"}}
    assert translate_response(sent, "anthropic", "anthropic")["container"] == sent["container"]


def test_relayed_openai_completion_is_completed_to_the_spec(specs):
    # What vLLM 0.32's /v1/chat/completions answers: optional members the schema has no null for, sent as null.
    relayed = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "service_tier": None,
               "system_fingerprint": None, "prompt_logprobs": None, "kv_transfer_params": None,
               "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                            "message": {"role": "assistant", "content": "Hello.", "refusal": None,
                                        "annotations": None, "audio": None, "function_call": None,
                                        "tool_calls": [], "reasoning": None}}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                         "prompt_tokens_details": None, "completion_tokens_details": None}}
    original = json.loads(json.dumps(relayed))
    assert errors_of(specs["openai-chat"], relayed, "CreateChatCompletionResponse") != []
    out = translate_response(relayed, "openai", "openai")
    assert errors_of(specs["openai-chat"], out, "CreateChatCompletionResponse") == []
    assert relayed == original  # copied, not changed in place (the record keeps what the server sent)
    message = out["choices"][0]["message"]
    assert "annotations" not in message and "function_call" not in message and message["tool_calls"] == []
    assert message["refusal"] is None and message["audio"] is None  # nullable in the schema: kept as sent
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert out["prompt_logprobs"] is None and "service_tier" not in out  # members outside the schema are kept


# ---------------------------------------------------------------------------------------------------------
# Open Responses (POST /v1/responses through the chat path)

REQUEST = {"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 32,
           "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}


@pytest.mark.parametrize("message,finish", [
    ({"content": "Hello."}, "stop"),
    ({"content": None, "tool_calls": [TOOL_CALL]}, "tool_calls"),
    ({"content": "Hel"}, "length"),
])
@pytest.mark.parametrize("body", [REQUEST, {"model": "m", "input": "hi"},
                                  {**REQUEST, "temperature": 0, "presence_penalty": 0.5, "tool_choice": "required"}])
def test_response_object_matches_the_spec(specs, message, finish, body):
    out = response_object(body, completion(message, finish), "rec1", 1_700_000_000.5)
    assert errors_of(specs["open-responses"], out, "ResponseResource") == []
    assert out["completed_at"] >= out["created_at"]
    assert out["status"] == ("incomplete" if finish == "length" else "completed")


def responses_events(frames: list[bytes]) -> list[dict]:
    out = []
    for frame in frames:
        kind, data = frame.decode().strip().split("\n")
        assert kind == f"event: {json.loads(data[6:])['type']}"
        out.append(json.loads(data[6:]))
    return out


def check_sequence(specs, events: list[dict]) -> None:
    spec = specs["open-responses"]
    for event in events:
        assert spec.validate_sse_event(event["type"], event) == [], event
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["completed_at"] is None
    terminal = events[-1]
    assert terminal["type"] in ("response.completed", "response.incomplete")
    assert terminal["response"]["completed_at"] is not None
    # every item added is done, in output order, with the final response listing the same items
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [item["id"] for item in terminal["response"]["output"]]


@pytest.mark.parametrize("case", ["text", "tools", "length"])
def test_responses_live_stream_matches_the_spec(specs, case):
    live = LiveStream(REQUEST, "rec1", 1_700_000_000.0)
    frames = live.start("m")
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    if case in ("text", "length"):
        chunks += [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("Hel", "lo.")]
    else:
        chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": ""}}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}]
    for c in chunks:
        frames += live.feed(c)
    message = {"content": "Hello."} if case != "tools" else {
        "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": "{}"}}]}
    final = response_object(REQUEST, completion(message, "length" if case == "length" else "stop"), "rec1",
                            1_700_000_000.0)
    frames += live.finish(final)
    check_sequence(specs, responses_events(frames))


@pytest.mark.parametrize("message", [{"content": "Hello."}, {"content": ""},
                                     {"content": "Let me look.", "tool_calls": [TOOL_CALL]}])
def test_responses_replayed_stream_matches_the_spec(specs, message):
    response = response_object(REQUEST, completion(message, "stop"), "rec1", 1_700_000_000.0)

    async def collect():
        return [frame async for frame in _event_stream(response, "rec1")]

    frames = asyncio.run(collect())
    check_sequence(specs, responses_events(frames))


def test_responses_error_event_matches_the_spec(specs):
    live = LiveStream(REQUEST, "rec1", 1_700_000_000.0)
    live.start("m")
    (event,) = responses_events(live.error("the provider connection broke off mid-stream", "rec1"))
    assert specs["open-responses"].validate_sse_event("error", event) == []
    assert event["error"]["message"] == event["message"]  # the spec's payload, and the OpenAI SDKs' members


# ---------------------------------------------------------------------------------------------------------
# llm-comply itself against reef serve, on each engine kind

ENGINES = {
    "upstream-openai": ("engine.kind=upstream", "engine.upstream_dialect=openai"),
    "upstream-anthropic": ("engine.kind=upstream", "engine.upstream_dialect=anthropic"),
    "local": ("engine.kind=local", "engine.max_new_tokens=64", "engine.seed=0", "engine.temperature=0"),
    # The SGLang engine's own path (a weights recipe: Reef renders, generates from token ids over /generate and
    # builds the answer) against the fake SGLang; the real vLLM's both paths are tests/engines/real/test_vllm_comply.py.
    "sglang-fake": ("+recipe=sao", "+sao_profile=tiny", "engine.kind=sglang", "engine.max_new_tokens=64",
                    "engine.seed=0", "engine.temperature=0"),
}
#: Engines on the fake tool-calling model: the tiny model's limits apply.
TINY = {"local", "sglang-fake"}


@pytest.fixture(scope="module")
def fake_sglang_url(fake_tool_model_dir):
    from reef_core.testing.fake_sglang import serve_fake_sglang

    with serve_fake_sglang(fake_tool_model_dir, mode="process") as url:
        yield url
@pytest.fixture(scope="module", params=sorted(ENGINES))
def served(request, module_reef_server, fake_upstream_url):
    overrides = ENGINES[request.param]
    if request.param.startswith("upstream"):
        overrides = (*overrides, f"engine.upstream_url={fake_upstream_url}", "engine.upstream_model=fake-model")
    else:
        overrides = (*overrides, f"engine.model={request.getfixturevalue('fake_tool_model_dir')}")
    if request.param == "sglang-fake":
        overrides = (*overrides, f"engine.url={request.getfixturevalue('fake_sglang_url')}")
    return request.param, module_reef_server(*overrides, timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_llm_comply_passes(served, fmt):
    engine, server = served
    outcome = run_format(f"{server.url}/v1", fmt, scenario=f"comply-{fmt}",
                         allowed=TINY_MODEL_LIMITS if engine in TINY else None)
    print(f"llm-comply {fmt} through {engine}: {outcome.summary}")  # the figures of the closing note (pytest -s)
    assert outcome.unexpected == {}, json.dumps(outcome.unexpected, indent=1)
