"""``engine.upstream_responses=true``: ``POST /v1/responses`` is passed through unchanged to an upstream that serves
the Responses API (the fake upstream's ``/v1/responses``), plain and streamed, recorded with a receipt."""

from __future__ import annotations

import httpx
import openai
import pytest

from reef_core.testing.fixtures import sse_events

TOOL = {"type": "function", "name": "echo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", "engine.upstream_dialect=openai", "engine.upstream_responses=true",
                              f"engine.upstream_url={fake_upstream_url}", "engine.upstream_model=fake-model")


def api(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                         default_headers={"x-reef-scenario": "passthrough"})


def stored(server, receipt):
    return httpx.get(f"{server.url}/reef/scenarios/passthrough/records/{receipt}").json()["payload"]


def test_plain_request_reaches_the_upstream_responses_route(server, upstream):
    raw = api(server).responses.with_raw_response.create(model="m", input="say hi", instructions="Be brief.")
    response = raw.parse()
    assert response.id.startswith("resp_fake") and response.output_text == "echo: say hi"  # the upstream's own
    receipt = raw.headers["x-reef-agent-record-id"]
    payload = stored(server, receipt)
    assert payload["route"] == "responses" and payload["response"]["id"] == response.id
    assert payload["request"]["instructions"] == "Be brief."
    assert [r["route"] for r in upstream.requests()] == ["responses"]


def test_stream_is_relayed_with_the_receipt_on_its_terminal_event(server):
    with httpx.stream("POST", f"{server.url}/v1/responses", headers={"x-reef-scenario": "passthrough"}, timeout=60,
                      json={"model": "m", "input": "one two three", "stream": True}) as answer:
        assert answer.status_code == 200
        events = sse_events(answer)
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [data["delta"] for _, data in events if data["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "echo: one two three"
    receipt = events[-1][1]["reef"]["agent_record_id"]
    assert stored(server, receipt)["response"]["id"] == events[-1][1]["response"]["id"]
    streamed = list(api(server).responses.create(model="m", input="hello there", stream=True))
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == "echo: hello there"


def test_function_tool_is_passed_through(server):
    response = api(server).responses.create(model="m", input="use it", tools=[TOOL], tool_choice="required")
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "echo"
