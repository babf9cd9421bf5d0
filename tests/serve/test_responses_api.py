"""``POST /v1/responses`` through the official ``openai`` SDK (issue #20 item 2): plain and streamed, function tools
through an Anthropic upstream, ``previous_response_id`` chains stored as records, ``store``, ``instructions``,
receipts and the door."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.responses import Response

ENGINES = {
    "upstream-openai": ("engine.kind=upstream", "engine.upstream_dialect=openai"),
    "upstream-anthropic": ("engine.kind=upstream", "engine.upstream_dialect=anthropic"),
    "local": ("engine.kind=local", "engine.max_new_tokens=32", "engine.seed=0", "engine.temperature=0"),
}
TOOL = {"type": "function", "name": "echo",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, module_reef_server, fake_upstream_url):
    overrides = ENGINES[request.param]
    if request.param.startswith("upstream"):
        overrides = (*overrides, f"engine.upstream_url={fake_upstream_url}", "engine.upstream_model=fake-model")
    else:  # a tiny model fine-tuned to call tools, in the Hermes convention
        overrides = (*overrides, f"engine.model={request.getfixturevalue('fake_tool_model_dir')}")
    return request.param, module_reef_server(*overrides, timeout=300)


def client(server, scenario="responses"):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", default_headers={"x-reef-scenario": scenario},
                         max_retries=0)


def payload(server, scenario, record_id):
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{record_id}").json()["payload"]


def test_plain_response_with_receipt_and_instructions(engine):
    name, server = engine
    raw = client(server).responses.with_raw_response.create(model="m", input="say hello", instructions="Be brief.",
                                                            max_output_tokens=8)
    response = raw.parse()
    receipt = raw.headers["x-reef-agent-record-id"]
    assert response.id == f"resp_{receipt}" and response.object == "response"
    assert response.output_text and response.usage.output_tokens >= 1
    Response.model_validate(raw.http_response.json(), strict=True)
    stored = payload(server, "responses", receipt)
    request = stored["request"]  # the chat exchange the engine served, in its dialect
    system = request.get("system") if stored["dialect"] == "anthropic" else request["messages"][0]["content"]
    assert "Be brief." in str(system)
    assert stored["responses"] == {"response_id": response.id, "previous_response_id": None, "store": True,
                                   "instructions": True}


def test_streamed_response_typed_events(engine):
    _, server = engine
    events = list(client(server).responses.create(model="m", input="say hello", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text
    assert len(deltas) > 1  # relayed as generated, not one block built from the finished answer
    assert final.usage.output_tokens >= 1
    receipt = final.id[len("resp_"):]
    assert payload(server, "responses", receipt)["responses"]["response_id"] == final.id


def test_previous_response_chain_and_store_false(engine):
    _, server = engine
    api = client(server, "responses-chain")
    first = api.responses.create(model="m", input="first question", instructions="Sys one.", max_output_tokens=8)
    second = api.responses.create(model="m", input="second question", previous_response_id=first.id,
                                  max_output_tokens=8)
    stored = payload(server, "responses-chain", second.id[len("resp_"):])
    assert stored["responses"]["previous_response_id"] == first.id
    texts = [str(m.get("content")) for m in stored["request"]["messages"]]
    assert any("first question" in t for t in texts) and any("second question" in t for t in texts)
    assert not any("Sys one." in t for t in texts)  # instructions do not carry over
    hidden = api.responses.create(model="m", input="q", store=False, max_output_tokens=8)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model="m", input="again", previous_response_id=hidden.id)
    with pytest.raises(openai.NotFoundError):
        client(server, "other-scenario").responses.create(model="m", input="x", previous_response_id=first.id)


def test_function_tool_round_trip(engine):
    _, server = engine
    api = client(server, "responses-tools")
    response = api.responses.create(model="m", input="use the tool", tools=[TOOL], tool_choice="required")
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "echo"
    follow = api.responses.create(model="m", previous_response_id=response.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "echoed"}])
    assert follow.status == "completed" and follow.output_text


def test_streamed_function_call(engine):
    _, server = engine
    events = list(client(server, "responses-tools").responses.create(
        model="m", input="use the tool", tools=[TOOL], tool_choice="required", stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added and added[0].name == "echo"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                        and e.item_id == added[0].id)
    final = [item for item in events[-1].response.output if item.type == "function_call"]
    assert final[0].id == added[0].id and final[0].arguments == arguments and final[0].call_id == added[0].call_id
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == arguments


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 5}, "input"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "store": "yes"}, "store"),
])
def test_door_refuses_bad_bodies_and_creates_nothing(engine, body, param):
    _, server = engine
    answer = httpx.post(f"{server.url}/v1/responses", headers={"x-reef-scenario": "responses-door"}, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert httpx.get(f"{server.url}/reef/scenarios/responses-door/records").status_code == 404


def test_idempotency_key_and_tags_as_on_chat(engine):
    _, server = engine
    headers = {"x-reef-scenario": "responses-idem", "idempotency-key": "k-1", "x-reef-tag-session": "s1"}
    body = {"model": "m", "input": "once only", "max_output_tokens": 8}
    first = httpx.post(f"{server.url}/v1/responses", headers=headers, json=body)
    again = httpx.post(f"{server.url}/v1/responses", headers=headers, json=body)
    assert first.status_code == again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"] and again.headers.get("x-reef-replayed") == "true"
    rows = httpx.get(f"{server.url}/reef/scenarios/responses-idem/records").json()["records"]
    assert len(rows) == 1
    other = httpx.post(f"{server.url}/v1/responses", headers=headers, json={**body, "input": "different"})
    assert other.status_code == 409
