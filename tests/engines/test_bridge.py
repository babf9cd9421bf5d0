"""End to end through the official SDKs: either client dialect against either provider dialect.

A minimal ASGI front (standing in for the server) relays through :class:`DialectBridge`; the OpenAI and
Anthropic SDKs talk to it over loopback HTTP and parse everything -- bodies, SSE streams, errors -- with
their own strict models.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from reef_core.engines.base import DirectResponse, EngineRequest
from reef_core.engines.bridge import DialectBridge
from reef_core.engines.sse import encode_event
from reef_core.engines.translate import error_body
from reef_core.engines.upstream import UpstreamEngine
from reef_core.errors import ReefError
from reef_core.testing import serve_asgi

ROUTES = {"/v1/chat/completions": ("openai", "chat"), "/v1/messages": ("anthropic", "messages"),
          "/v1/messages/count_tokens": ("anthropic", "count_tokens")}


class MiniFront:
    """The smallest server that relays through an engine: enough to drive the SDKs."""

    def __init__(self, make_engine):
        self.make_engine = make_engine
        self.engine = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    self.engine = DialectBridge(self.make_engine(), default_max_tokens=64)
                    await self.engine.start()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await self.engine.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        dialect, route = ROUTES[scope["path"]]
        body = json.loads(raw)
        req = EngineRequest(dialect, route, body, {})
        try:
            if body.get("stream"):
                gen = self.engine.stream(req)
                first = await anext(gen)  # DirectResponse / errors surface before any byte is sent
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
                ev = first
                while True:
                    if not ev.is_reef:
                        await send({"type": "http.response.body", "body": encode_event(ev), "more_body": True})
                    try:
                        ev = await anext(gen)
                    except StopAsyncIteration:
                        break
                await send({"type": "http.response.body", "body": b""})
                return
            resp = await (self.engine.count_tokens(req) if route == "count_tokens" else self.engine.complete(req))
            status, out, headers = resp.status, resp.body, resp.headers
        except DirectResponse as d:
            status, out, headers = d.response.status, d.response.body, d.response.headers
        except ReefError as exc:
            status, out, headers = exc.status, error_body(dialect, exc.status, exc.message), {}
        extra = [(b"retry-after", headers["retry-after"].encode())] if "retry-after" in headers else []
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *extra]})
        await send({"type": "http.response.body", "body": data})


@pytest.fixture
def front_over(fake, api_key):
    """front_over(provider_dialect) -> base URL of a MiniFront relaying to the fake in that dialect."""
    _, url = fake
    stack = []

    def start(dialect):
        cm = serve_asgi(MiniFront(lambda: UpstreamEngine(url, api_key=api_key, dialect=dialect)), lifespan="on")
        stack.append(cm)
        return cm.__enter__()

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


TOOLS_ANTHROPIC = [{"name": "lookup", "description": "look it up",
                    "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}]


def test_anthropic_sdk_over_openai_provider(front_over, fake):
    base = front_over("openai")
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi there"}]
    msg = client.messages.create(model="m", max_tokens=20, messages=msgs, system="sys")
    assert msg.content[0].text == "echo: hi there" and msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens == 3 and msg.usage.output_tokens == 3
    with client.messages.stream(model="m", max_tokens=2, messages=msgs) as s:
        deltas = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(deltas) == final.content[0].text == "echo: hi "
    assert final.stop_reason == "max_tokens"
    with client.messages.stream(model="m", max_tokens=20, messages=msgs, tools=TOOLS_ANTHROPIC,
                                tool_choice={"type": "tool", "name": "lookup"}) as s:
        final = s.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"text": "hi there"}
    assert final.stop_reason == "tool_use"
    sent = fake[0].requests_log()[0]["body"]  # what the provider received: a real OpenAI body
    assert sent["messages"][0] == {"role": "system", "content": "sys"} and sent["max_tokens"] == 20


def test_openai_sdk_over_anthropic_provider(front_over):
    base = front_over("anthropic")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "good day"}]
    r = client.chat.completions.create(model="m", messages=msgs)  # no max_tokens: the bridge's default fills in
    assert r.choices[0].message.content == "echo: good day" and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 3)
    chunks = list(client.chat.completions.create(model="m", messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: good day"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    r = client.chat.completions.create(model="m", messages=msgs, tools=[tool], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"text": "good day"}
    with client.chat.completions.stream(model="m", messages=msgs, tools=[tool], tool_choice="required") as s:
        final = s.get_final_completion()
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == {"text": "good day"}


def test_relayed_errors_arrive_in_the_clients_dialect(front_over, fake):
    app, _ = fake
    base = front_over("openai")
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    app.add_faults({"status": 429, "retry_after": 3}, {"status": 429, "retry_after": 3})
    with pytest.raises(anthropic.RateLimitError) as info:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "injected fault 429" in info.value.message and info.value.response.headers["retry-after"] == "3"
    with pytest.raises(anthropic.RateLimitError):
        with client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]) as s:
            s.get_final_message()
    app.add_faults({"status": 500})
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 502


def test_anthropic_sdk_over_local_model(tiny_model_dir):
    from reef_core.engines.local import LocalEngine

    with serve_asgi(MiniFront(lambda: LocalEngine(tiny_model_dir, max_new_tokens=16)), lifespan="on") as base:
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "What is 1 + 1?"}]
        whole = client.messages.create(model="tiny", max_tokens=12, messages=msgs, system="sys",
                                       extra_body={"temperature": 0})
        with client.messages.stream(model="tiny", max_tokens=12, messages=msgs, system="sys",
                                       extra_body={"temperature": 0}) as s:
            streamed = s.get_final_message()
        counted = client.messages.count_tokens(model="tiny", messages=msgs, system="sys")
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason in ("end_turn", "max_tokens")
    assert streamed.usage.output_tokens == whole.usage.output_tokens > 0
    assert counted.input_tokens == whole.usage.input_tokens > 0
