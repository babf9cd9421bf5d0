"""Dialect conformance: every engine x client dialect x (plain, stream, tools, error) answers with bodies the
providers' published schemas accept (issue #20 item 1).

The schema is the official SDKs' pydantic types (``openai.types.chat``, ``anthropic.types``), validated in strict
mode on the raw JSON, plus the members the published schemas list as required that the SDK types leave optional
(Anthropic ``citations`` on text blocks and the usage members, OpenAI ``message.annotations`` / ``refusal``).
The embedded engine serves the fake tool-calling model (a tiny model fine-tuned on a few tool-call exchanges, with a
Hermes-convention chat template), so its tool calls are parsed from what the model wrote.
"""

from __future__ import annotations

import anthropic.types as at
import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import TypeAdapter

from reef_core.testing.fixtures import sse_events

ANTHROPIC_USAGE = {"input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                   "cache_creation", "server_tool_use", "service_tier"}
ANTHROPIC_MESSAGE = {"id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"}
OPENAI_MESSAGE = {"role", "content", "refusal", "annotations"}
OPENAI_CHOICE = {"index", "message", "finish_reason", "logprobs"}
STREAM_EVENT = TypeAdapter(at.RawMessageStreamEvent)

ENGINES = {
    "upstream-openai": ("engine.kind=upstream", "engine.upstream_dialect=openai"),
    "upstream-anthropic": ("engine.kind=upstream", "engine.upstream_dialect=anthropic"),
    "local": ("engine.kind=local", "engine.max_new_tokens=8", "engine.seed=0", "engine.temperature=0"),
}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, module_reef_server, fake_upstream_url):
    overrides = ENGINES[request.param]
    if request.param.startswith("upstream"):
        overrides = (*overrides, f"engine.upstream_url={fake_upstream_url}", "engine.upstream_model=fake-model")
    else:
        overrides = (*overrides, f"engine.model={request.getfixturevalue('fake_tool_model_dir')}")
    return request.param, module_reef_server(*overrides, timeout=300)


def post(server, path, body, headers=None):
    return httpx.post(f"{server.url}{path}", headers={"x-reef-scenario": "conformance", **(headers or {})}, json=body,
                      timeout=120)


def openai_body(case):
    body = {"model": "m", "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 8}
    if case == "tools":
        body.update(max_tokens=64, tools=[{"type": "function", "function": {"name": "echo", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}}}}], tool_choice="required")
    return body


def anthropic_body(case):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "say hello"}]}
    if case == "tools":
        body.update(max_tokens=64, tools=[{"name": "echo", "input_schema": {"type": "object",
                                                             "properties": {"text": {"type": "string"}}}}],
                    tool_choice={"type": "any"})
    return body


def check_openai_completion(raw: dict, case: str) -> None:
    ChatCompletion.model_validate(raw, strict=True)
    choice = raw["choices"][0]
    assert OPENAI_CHOICE <= set(choice), choice
    assert OPENAI_MESSAGE <= set(choice["message"]), choice["message"]
    if case == "tools":
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "echo"


def check_anthropic_message(raw: dict, case: str) -> None:
    at.Message.model_validate(raw, strict=True)
    assert ANTHROPIC_MESSAGE <= set(raw), raw
    assert ANTHROPIC_USAGE <= set(raw["usage"]), raw["usage"]
    for block in raw["content"]:
        if block["type"] == "text":
            assert "citations" in block, block
    if case == "tools":
        assert any(b["type"] == "tool_use" and b["name"] == "echo" for b in raw["content"])


@pytest.mark.parametrize("case", ["plain", "tools"])
def test_openai_client_plain(engine, case):
    _, server = engine
    response = post(server, "/v1/chat/completions", openai_body(case))
    assert response.status_code == 200, response.text
    check_openai_completion(response.json(), case)


@pytest.mark.parametrize("case", ["plain", "tools"])
def test_anthropic_client_plain(engine, case):
    _, server = engine
    response = post(server, "/v1/messages", anthropic_body(case), headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 200, response.text
    check_anthropic_message(response.json(), case)


@pytest.mark.parametrize("case", ["plain", "tools"])
def test_openai_client_stream_with_usage(engine, case):
    _, server = engine
    body = {**openai_body(case), "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"x-reef-scenario": "conformance"}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _, data in events[:-1]]
    for chunk in chunks:
        if "reef" in chunk:  # Reef's receipt chunk: empty choices plus the receipt
            assert chunk["choices"] == [] and chunk["reef"]["agent_record_id"]
            continue
        ChatCompletionChunk.model_validate(chunk, strict=True)
    usage = [c for c in chunks if c.get("usage") and c["choices"] == []]
    assert len(usage) == 1, chunks
    if case == "tools":
        calls = [tc for c in chunks for choice in c["choices"] for tc in choice["delta"].get("tool_calls") or []]
        assert calls and calls[0]["function"]["name"] == "echo", chunks
    assert usage[0]["usage"]["completion_tokens"] >= 1
    counts = usage[0]["usage"]
    assert counts["total_tokens"] == counts["prompt_tokens"] + counts["completion_tokens"]


@pytest.mark.parametrize("case", ["plain", "tools"])
def test_anthropic_client_stream(engine, case):
    _, server = engine
    body = {**anthropic_body(case), "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=120,
                      headers={"x-reef-scenario": "conformance", "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    for event_name, data in events:
        if event_name == "ping":
            continue
        STREAM_EVENT.validate_python(data, strict=True)
        assert data["type"] == event_name
    start = events[0][1]["message"]
    assert ANTHROPIC_USAGE <= set(start["usage"]), start["usage"]
    if case == "tools":
        blocks = [data["content_block"] for name, data in events if name == "content_block_start"]
        assert any(b["type"] == "tool_use" and b["name"] == "echo" for b in blocks), blocks


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
])
def test_missing_required_member_is_a_400_in_the_dialect(engine, path, body, param):
    _, server = engine
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    raw = response.json()
    if path.startswith("/v1/messages"):
        assert raw["type"] == "error" and raw["error"]["type"] == "invalid_request_error"
        assert param in raw["error"]["message"]
    else:
        assert raw["error"]["type"] == "invalid_request_error" and raw["error"]["param"] == param
