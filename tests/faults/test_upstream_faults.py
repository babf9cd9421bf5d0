"""What clients of `reef serve` see when the provider misbehaves, and what the store keeps.

The provider is FakeUpstream in its own process, told through its control route which fault to inject into the
next request. Every test ends by reading back all records of its own scenario through the records route: a failed
non-streamed call leaves no record (no orphan), a broken stream leaves exactly one record marked incomplete, and
a healthy call made afterwards leaves exactly the record its receipt names (no duplicate, server still healthy).
"""

from __future__ import annotations

import httpx
import pytest

from reef_core.testing.fixtures import sse_events

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RECEIPT = "x-reef-agent-record-id"


def body_for(path: str, text: str, **extra) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    if path == MESSAGES:
        body["max_tokens"] = 64
    return body


def post(server, scenario: str, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-reef-scenario": scenario}, timeout=timeout)


def stream_events(server, scenario: str, path: str, body: dict) -> tuple[int, list[tuple[str | None, object]]]:
    """POST a streaming request; return the status and the SSE events as ``(event name, parsed data)``."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      headers={"x-reef-scenario": scenario}, timeout=30) as response:
        return response.status_code, sse_events(response)


def error_message(path: str, response: httpx.Response) -> str:
    """The error message, checking the body has the shape of the route's dialect."""
    body = response.json()
    if path == MESSAGES:
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
    else:
        assert set(body["error"]) >= {"message", "type"}, body
    return body["error"]["message"]


@pytest.fixture(autouse=True)
def _provider_settles(upstream, wait_for):
    # A delayed fault keeps the provider busy after Reef gave up: let it finish before the next test resets its
    # counters, so in-flight counts stay exact.
    yield
    wait_for(lambda: upstream.stats()["in_flight"] == 0, what="the provider to finish in-flight requests")


def assert_healthy_and_only(server, upstream, scenario, records_of, path, expected_before):
    """A healthy call now succeeds, and the scenario holds exactly ``expected_before`` plus its record."""
    response = post(server, scenario, path, body_for(path, "after the fault"))
    assert response.status_code == 200, response.text
    receipt = response.headers[RECEIPT]
    ids = [r["agent_record_id"] for r in records_of(server.url, scenario)]
    assert ids == [*expected_before, receipt]
    return receipt


# -- non-streamed faults: an honest status, never a record ---------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_rate_limit_is_relayed_with_retry_after(fault_server, upstream, scenario, records_of, path):
    upstream.faults({"status": 429, "retry_after": 7})
    response = post(fault_server, scenario, path, body_for(path, "too fast"))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert RECEIPT not in response.headers
    assert "injected fault 429" in error_message(path, response)  # the provider's own message
    assert upstream.stats()["requests"] == 1  # Reef never retries on the client's behalf
    assert records_of(fault_server.url, scenario) == []
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, path, [])


@pytest.mark.parametrize("path,status", [(CHAT, 500), (MESSAGES, 502), (CHAT, 529)])  # 503: relayed (D8)
def test_provider_5xx_becomes_502(fault_server, upstream, scenario, records_of, path, status):
    upstream.faults({"status": status})
    response = post(fault_server, scenario, path, body_for(path, "server trouble"))
    assert response.status_code == 502
    assert str(status) in error_message(path, response)
    assert upstream.stats()["requests"] == 1
    assert records_of(fault_server.url, scenario) == []
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, path, [])


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_connection_reset_becomes_502(fault_server, upstream, scenario, records_of, path):
    upstream.faults({"reset": True})
    response = post(fault_server, scenario, path, body_for(path, "hang up"))
    assert response.status_code == 502
    assert "connection" in error_message(path, response).lower()
    assert upstream.stats()["requests"] == 1  # the request reached the provider once and was not replayed
    assert records_of(fault_server.url, scenario) == []
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, path, [])


def test_invalid_json_becomes_502(fault_server, upstream, scenario, records_of):
    upstream.faults({"invalid_json": True})
    response = post(fault_server, scenario, CHAT, body_for(CHAT, "garbled"))
    assert response.status_code == 502
    assert "invalid JSON" in error_message(CHAT, response)
    assert records_of(fault_server.url, scenario) == []
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, CHAT, [])


def test_slow_provider_times_out_with_504(fault_server, upstream, scenario, records_of, wait_for):
    upstream.faults({"delay_s": 3.0})  # the server's engine.timeout_s is 2
    response = post(fault_server, scenario, CHAT, body_for(CHAT, "slow"))
    assert response.status_code == 504
    assert "did not answer" in error_message(CHAT, response)
    # The provider answers after Reef gave up; that late answer must not become a record either.
    wait_for(lambda: upstream.stats()["in_flight"] == 0, what="the late provider answer")
    assert records_of(fault_server.url, scenario) == []
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, CHAT, [])


# -- oversized provider bodies ------------------------------------------------------------------------------------
# (A body over the engine's 64 MiB cap is refused from its content-length before any read; building one in the fake
# takes long enough on a loaded CI box to trip the 2 s timeout, so that bound is left to the engine's own tests.)

def test_large_provider_body_is_relayed_and_recorded(fault_server, upstream, scenario, records_of):
    upstream.faults({"oversized_bytes": 2_000_000})
    response = post(fault_server, scenario, CHAT, body_for(CHAT, "big"))
    assert response.status_code == 200
    assert len(response.json()["padding"]) == 2_000_000
    receipt = response.headers[RECEIPT]
    record = httpx.get(f"{fault_server.url}/reef/scenarios/{scenario}/records/{receipt}", timeout=30).json()
    assert record["complete"] is True and len(record["payload"]["response"]["padding"]) == 2_000_000
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, CHAT, [receipt])


# -- broken streams: a clean error event, one incomplete record ---------------------------------------------------

def _check_broken_stream(server, scenario, records_of, path, events, why: str):
    name, last = events[-1]
    if path == MESSAGES:
        assert name == "error" and last["type"] == "error"
        assert all(n != "message_stop" for n, _ in events)
    else:
        assert "error" in last
        assert all(data != "[DONE]" for _, data in events)
    assert last["reef"]["complete"] is False
    receipt = last["reef"]["agent_record_id"]
    rows = records_of(server.url, scenario)
    assert [(r["agent_record_id"], r["complete"]) for r in rows] == [(receipt, False)]
    record = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{receipt}", timeout=30).json()
    assert record["payload"]["stream"] is True
    assert why in record["payload"]["error"]
    return receipt


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("fault,why", [
    ({"truncate_after": 3}, "ended"),
    ({"reset_after_events": 3}, "connection"),
    ({"stream_error": True}, "stream error"),
    ({"invalid_json": True}, "invalid JSON"),
], ids=["truncated", "reset", "error-event", "invalid-json"])
def test_broken_stream_ends_with_error_event_and_incomplete_record(fault_server, upstream, scenario, records_of,
                                                                   path, fault, why):
    upstream.faults(fault)
    status, events = stream_events(fault_server, scenario, path, body_for(path, "a stream that breaks midway"))
    assert status == 200  # headers left before the fault
    assert len(events) >= 2  # some of the stream was relayed before it broke
    receipt = _check_broken_stream(fault_server, scenario, records_of, path, events, why)
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, path, [receipt])


def test_stalled_stream_times_out_with_error_event(fault_server, upstream, scenario, records_of):
    # First event at once, the second only after 3 s: past engine.timeout_s (2 s) between reads.
    upstream.faults({"chunk_delay_s": 3.0, "truncate_after": 2})
    status, events = stream_events(fault_server, scenario, CHAT, body_for(CHAT, "stall"))
    assert status == 200
    receipt = _check_broken_stream(fault_server, scenario, records_of, CHAT, events, "stalled")
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, CHAT, [receipt])


def test_stream_with_a_large_event_completes(fault_server, upstream, scenario, records_of):
    upstream.faults({"oversized_bytes": 2_000_000})
    status, events = stream_events(fault_server, scenario, CHAT, body_for(CHAT, "big stream event"))
    assert status == 200
    assert events[-1][1] == "[DONE]"
    receipt = events[-2][1]["reef"]["agent_record_id"]
    rows = records_of(fault_server.url, scenario)
    assert [(r["agent_record_id"], r["complete"]) for r in rows] == [(receipt, True)]
    assert_healthy_and_only(fault_server, upstream, scenario, records_of, CHAT, [receipt])
