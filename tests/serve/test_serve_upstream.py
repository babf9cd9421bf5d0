"""`reef serve` with the upstream engine, driven by the official openai and anthropic SDKs.

The upstream is FakeUpstream, a protocol-faithful fake provider in its own process; Reef runs as
a real `reef serve` process; records live in real SQLite or PostgreSQL.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest


@pytest.fixture
def sc(request):
    """A scenario name of the test's own, so tests can share one server."""
    return re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:60]


@pytest.fixture(scope="module")
def shared(module_reef_server, fake_upstream_url, store_overrides):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *store_overrides)


@pytest.fixture
def server(reef_server, fake_upstream_url, store_overrides):
    """A server of the test's own (for tests that restart it or count all records)."""
    return reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *store_overrides)


def oai(server, **kwargs):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", **kwargs)


def claude(server, **kwargs):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", **kwargs)


def get_record(server, record_id, scenario):
    response = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{record_id}")
    assert response.status_code == 200, response.text
    return response.json()


def test_openai_chat_receipts_and_records(shared, upstream, sc):
    client = oai(shared)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hello there"}],
        extra_headers={"x-reef-scenario": sc, "x-reef-tag-session": "abc", "x-reef-tag-Client": "cli"})
    receipt = raw.headers["x-reef-agent-record-id"]
    completion = raw.parse()
    assert completion.choices[0].message.content == "echo: hello there"
    record = get_record(shared, receipt, sc)
    assert record["request_type"] == "inference" and record["complete"] is True
    assert record["tags"] == {"session": "abc", "client": "cli"}
    assert record["payload"]["request"]["messages"][0]["content"] == "hello there"
    assert record["payload"]["response"]["choices"][0]["message"]["content"] == "echo: hello there"

    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "stream me please"}],
                                            stream=True, extra_headers={"x-reef-scenario": sc})
    text, receipts = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        elif (chunk.model_extra or {}).get("reef"):
            receipts.append(chunk.model_extra["reef"]["agent_record_id"])
    assert text == "echo: stream me please"
    assert len(receipts) == 1
    streamed = get_record(shared, receipts[0], sc)
    assert streamed["complete"] is True and streamed["payload"]["stream"] is True
    assert streamed["payload"]["response"]["choices"][0]["message"]["content"] == text

    listing = httpx.get(f"{shared.url}/reef/scenarios/{sc}/records").json()
    assert [r["agent_record_id"] for r in listing["records"]] == [receipt, receipts[0]]
    assert [r["sequence"] for r in listing["records"]] == [1, 2]


def test_anthropic_messages_receipts_and_strict_stream(shared, upstream, sc):
    client = claude(shared)
    raw = client.messages.with_raw_response.create(model="m", max_tokens=50, extra_headers={"x-reef-scenario": sc},
                                                   messages=[{"role": "user", "content": "hi claude"}])
    receipt = raw.headers["x-reef-agent-record-id"]
    assert raw.parse().content[0].text == "echo: hi claude"
    assert get_record(shared, receipt, sc)["payload"]["client_dialect"] == "anthropic"

    events = list(client.messages.create(model="m", max_tokens=50, stream=True, extra_headers={"x-reef-scenario": sc},
                                         messages=[{"role": "user", "content": "stream claude"}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    stop_receipt = events[-1].model_extra["reef"]["agent_record_id"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "echo: stream claude"
    # Records keep the exchange as it went to and came from the (OpenAI-dialect) upstream.
    assert get_record(shared, stop_receipt, sc)["payload"]["response"]["choices"][0]["message"]["content"] == text

    with client.messages.stream(model="m", max_tokens=50, extra_headers={"x-reef-scenario": sc},
                                messages=[{"role": "user", "content": "helper stream"}]) as stream:
        assert stream.get_final_message().content[0].text == "echo: helper stream"

    counted = client.messages.with_raw_response.count_tokens(
        model="m", messages=[{"role": "user", "content": "one two three"}], extra_headers={"x-reef-scenario": sc})
    assert counted.parse().input_tokens > 0
    assert counted.headers["x-reef-agent-record-id"]
    assert counted.headers["x-reef-token-count"] == "estimate"  # model "m": no tokenizer is known


def test_models_route(shared, upstream, sc):
    assert oai(shared).models.list().data[0].id


def test_either_client_works_with_either_upstream_dialect(reef_server, fake_upstream_url, upstream, sc):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                         "engine.upstream_dialect=anthropic")
    raw = oai(server).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "cross over"}],
        extra_headers={"x-reef-scenario": sc})
    assert raw.parse().choices[0].message.content == "echo: cross over"
    record = get_record(server, raw.headers["x-reef-agent-record-id"], sc)
    assert record["payload"]["dialect"] == "anthropic"  # the request as sent upstream
    assert record["payload"]["request"]["system"] == "be brief"
    chunks = list(oai(server).chat.completions.create(model="m", stream=True, extra_headers={"x-reef-scenario": sc},
                                                      messages=[{"role": "user", "content": "cross stream"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: cross stream"
    assert (chunks[-1].model_extra or {}).get("reef")


def test_records_survive_restart(server, upstream, sc):
    receipts = []
    for i in range(3):
        raw = oai(server).chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": f"keep {i}"}], extra_headers={"x-reef-scenario": sc})
        receipts.append(raw.headers["x-reef-agent-record-id"])
    server.kill()  # SIGKILL: no graceful flush
    server.start()
    for i, receipt in enumerate(receipts):
        assert get_record(server, receipt, sc)["payload"]["request"]["messages"][0]["content"] == f"keep {i}"
    scenarios = httpx.get(f"{server.url}/reef/scenarios").json()["scenarios"]
    assert sc in [s["scenario"] for s in scenarios]


def test_sdk_retry_after_upstream_failure_makes_one_record(shared, upstream, sc):
    upstream.faults({"status": 500, "fail_next": 1})
    client = oai(shared, max_retries=2)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "retry me"}], extra_headers={"x-reef-scenario": sc})
    assert raw.parse().choices[0].message.content == "echo: retry me"
    assert upstream.stats()["requests"] == 2
    records = httpx.get(f"{shared.url}/reef/scenarios/{sc}/records").json()["records"]
    assert [r["agent_record_id"] for r in records] == [raw.headers["x-reef-agent-record-id"]]


def test_sdk_retry_of_a_delivered_request_returns_the_same_record(shared, upstream, sc):
    body = {"model": "m", "messages": [{"role": "user", "content": "lost reply"}]}
    first = httpx.post(f"{shared.url}/v1/chat/completions", json=body, headers={"x-reef-scenario": sc})
    # The client never saw the first answer and retries the same request.
    retry = httpx.post(f"{shared.url}/v1/chat/completions", json=body,
                       headers={"x-reef-scenario": sc, "x-stainless-retry-count": "1"})
    assert retry.headers["x-reef-agent-record-id"] == first.headers["x-reef-agent-record-id"]
    assert retry.json()["choices"] == first.json()["choices"]
    keyed = {"x-reef-scenario": sc, "idempotency-key": "k-1"}
    a = httpx.post(f"{shared.url}/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "k"}]},
                   headers=keyed)
    b = httpx.post(f"{shared.url}/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "k"}]},
                   headers=keyed)
    assert a.headers["x-reef-agent-record-id"] == b.headers["x-reef-agent-record-id"]
    assert upstream.stats()["requests"] == 2
    assert len(httpx.get(f"{shared.url}/reef/scenarios/{sc}/records").json()["records"]) == 2


def test_client_supplied_record_id(shared, upstream, sc):
    body = {"model": "m", "messages": [{"role": "user", "content": "mine"}]}
    headers = {"x-reef-scenario": sc, "x-reef-agent-record-id": "client-id-1"}
    first = httpx.post(f"{shared.url}/v1/chat/completions", json=body, headers=headers)
    assert first.headers["x-reef-agent-record-id"] == "client-id-1"
    again = httpx.post(f"{shared.url}/v1/chat/completions", json=body, headers=headers)
    assert again.status_code == 200 and again.headers["x-reef-agent-record-id"] == "client-id-1"
    other = httpx.post(f"{shared.url}/v1/chat/completions",
                       json={**body, "messages": [{"role": "user", "content": "different"}]}, headers=headers)
    assert other.status_code == 409
    assert other.json()["error"]["type"] == "conflict_error"
    bad = httpx.post(f"{shared.url}/v1/chat/completions", json=body,
                     headers={"x-reef-scenario": sc, "x-reef-agent-record-id": "bad id!"})
    assert bad.status_code == 400


def test_errors_in_each_dialect(reef_server, fake_upstream_url, upstream, sc):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                         "server.max_body_bytes=2000", "engine.timeout_s=1")
    url = server.url
    missing = httpx.post(f"{url}/v1/chat/completions",
                         json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 400 and "x-reef-scenario" in missing.json()["error"]["message"]
    not_json = httpx.post(f"{url}/v1/messages", content=b"{nope", headers={"x-reef-scenario": sc})
    assert not_json.status_code == 400
    assert not_json.json()["type"] == "error" and not_json.json()["error"]["type"] == "invalid_request_error"
    big = httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": sc},
                     json={"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]})
    assert big.status_code == 413 and "error" in big.json()

    upstream.faults({"status": 429, "retry_after": 7})
    with pytest.raises(openai.RateLimitError) as info:
        oai(server, max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}],
                                                           extra_headers={"x-reef-scenario": sc})
    assert info.value.response.headers["retry-after"] == "7"
    upstream.faults({"status": 503})
    with pytest.raises(anthropic.APIStatusError) as info:
        claude(server, max_retries=0).messages.create(model="m", max_tokens=5, extra_headers={"x-reef-scenario": sc},
                                                      messages=[{"role": "user", "content": "b"}])
    assert info.value.status_code == 503  # relayed (#37 D8)
    upstream.faults({"delay_s": 3})
    timed_out = httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": sc}, timeout=30,
                           json={"model": "m", "messages": [{"role": "user", "content": "slow"}]})
    assert timed_out.status_code == 504
    # None of the failures produced a record, nor the scenario they named.
    assert httpx.get(f"{url}/reef/scenarios/{sc}/records").status_code == 404


def test_stream_cut_midway_is_recorded_incomplete(shared, upstream, sc):
    upstream.faults({"truncate_after": 2})
    with httpx.stream("POST", f"{shared.url}/v1/chat/completions", headers={"x-reef-scenario": sc},
                      json={"model": "m", "stream": True,
                            "messages": [{"role": "user", "content": "a long answer here"}]}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-1][len("data: "):])
    assert "error" in last and last["reef"]["complete"] is False
    record = get_record(shared, last["reef"]["agent_record_id"], sc)
    assert record["complete"] is False and record["payload"]["error"]
