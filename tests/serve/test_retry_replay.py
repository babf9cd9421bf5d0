"""Retries against `reef serve`: only a complete record is ever replayed.

A retry (same ``Idempotency-Key``, or an SDK retry of the same body) of a request whose record is incomplete (a
stream the provider cut short) runs again and stores a new record linked to the first (``payload.retry_of``); the
key then names the new, complete record, so a third try replays it. A key reused with another body is 409 in the
endpoint's dialect. The provider is FakeUpstream in its own process; Reef is a real `reef serve`.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from reef_core.testing.fixtures import sse_events

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RECEIPT = "x-reef-agent-record-id"


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")


@pytest.fixture
def sc():
    """A scenario (and so an idempotency-key space) of the test's own."""
    return f"retry-{uuid.uuid4().hex[:12]}"


def body_for(path: str, text: str, **extra) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    if path == MESSAGES:
        body["max_tokens"] = 64
    return body


def stream(server, path: str, body: dict, headers: dict) -> tuple[httpx.Response, list[tuple[str | None, object]]]:
    """POST a streaming request; the response and its SSE events as ``(event name, parsed data)``."""
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=30) as response:
        events = sse_events(response)
    return response, events


def reef_field(events) -> dict:
    """The ``reef`` field the stream ends with (receipt event, or the error event of a broken stream)."""
    found = [data["reef"] for _, data in events if isinstance(data, dict) and "reef" in data]
    assert len(found) == 1, events
    return found[0]


def finished(path: str, events) -> bool:
    """Whether the stream carried a real end of message (finish reason / stop reason) and its terminal event."""
    if path == CHAT:
        reasons = [c.get("finish_reason") for _, d in events if isinstance(d, dict) for c in d.get("choices") or ()]
        return any(reasons) and events[-1][1] == "[DONE]"
    stops = [d["delta"].get("stop_reason") for n, d in events if n == "message_delta"]
    return any(stops) and events[-1][0] == "message_stop"


def record(server, sc: str, record_id: str) -> dict:
    response = httpx.get(f"{server.url}/reef/scenarios/{sc}/records/{record_id}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def record_ids(server, sc: str) -> list[str]:
    response = httpx.get(f"{server.url}/reef/scenarios/{sc}/records", timeout=30)
    return [r["agent_record_id"] for r in response.json()["records"]]


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("how", ["idempotency_key", "sdk_retry"])
def test_retry_of_a_truncated_stream_runs_again(server, upstream, sc, path, how):
    body = body_for(path, "a long answer that the provider cuts short", stream=True)
    headers = {"x-reef-scenario": sc}
    if how == "idempotency_key":
        headers["idempotency-key"] = f"k-{sc}"
    upstream.faults({"truncate_after": 3})
    first, events = stream(server, path, body, headers)
    cut = reef_field(events)
    assert first.status_code == 200 and cut["complete"] is False and not finished(path, events)

    if how == "sdk_retry":
        headers = {**headers, "x-stainless-retry-count": "1"}
    retry, events = stream(server, path, body, headers)
    assert retry.status_code == 200 and "x-reef-replayed" not in retry.headers
    assert finished(path, events), events  # a real answer, not the stored fragment replayed
    second = reef_field(events)["agent_record_id"]
    assert second != cut["agent_record_id"]
    stored = record(server, sc, second)
    assert stored["complete"] is True and stored["payload"]["retry_of"] == cut["agent_record_id"]
    assert record(server, sc, cut["agent_record_id"])["complete"] is False  # the first attempt stays as it was
    assert upstream.stats()["requests"] == 2

    # A further retry now replays the complete record, as a stream and as a plain answer alike.
    again, events = stream(server, path, body, headers)
    assert again.headers.get("x-reef-replayed") == "true" and finished(path, events)
    assert reef_field(events)["agent_record_id"] == second
    assert upstream.stats()["requests"] == 2
    assert record_ids(server, sc) == [cut["agent_record_id"], second]


def test_each_retry_of_a_cut_attempt_links_to_the_one_before(server, upstream, sc):
    body = body_for(CHAT, "cut twice, then whole", stream=True)
    headers = {"x-reef-scenario": sc, "idempotency-key": f"k-{sc}"}
    upstream.faults({"truncate_after": 2, "times": 2})
    attempts = [reef_field(stream(server, CHAT, body, headers)[1]) for _ in range(3)]
    ids = [a["agent_record_id"] for a in attempts]
    assert [a.get("complete", True) for a in attempts] == [False, False, True] and len(set(ids)) == 3
    assert [record(server, sc, i)["payload"].get("retry_of") for i in ids] == [None, ids[0], ids[1]]
    assert reef_field(stream(server, CHAT, body, headers)[1])["agent_record_id"] == ids[2]
    assert upstream.stats()["requests"] == 3


def test_a_client_chosen_id_of_a_cut_stream_is_retried_under_a_new_id(server, upstream, sc):
    body = body_for(MESSAGES, "my own receipt, cut", stream=True)
    headers = {"x-reef-scenario": sc, RECEIPT: f"mine-{sc}"}
    upstream.faults({"truncate_after": 3})
    cut = reef_field(stream(server, MESSAGES, body, headers)[1])
    assert cut == {"agent_record_id": f"mine-{sc}", "complete": False}
    retry = reef_field(stream(server, MESSAGES, body, headers)[1])["agent_record_id"]
    assert retry != f"mine-{sc}" and record(server, sc, retry)["payload"]["retry_of"] == f"mine-{sc}"
    # The id still names the cut attempt; retrying it again replays the complete answer.
    response, events = stream(server, MESSAGES, body, headers)
    assert response.headers.get("x-reef-replayed") == "true" and reef_field(events)["agent_record_id"] == retry
    assert upstream.stats()["requests"] == 2


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_idempotency_key_reused_with_another_body_is_409(server, upstream, sc, path):
    headers = {"x-reef-scenario": sc, "idempotency-key": f"k-{sc}"}
    first = httpx.post(server.url + path, json=body_for(path, "first question"), headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    other = httpx.post(server.url + path, json=body_for(path, "another question"), headers=headers, timeout=30)
    assert other.status_code == 409, other.text
    error = other.json()
    assert "idempotency" in error["error"]["message"].lower()
    if path == MESSAGES:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert error["error"]["type"] == "conflict_error"
    # The same key and body still replays the first answer; nothing else was stored or sent upstream.
    same = httpx.post(server.url + path, json=body_for(path, "first question"), headers=headers, timeout=30)
    assert same.headers[RECEIPT] == first.headers[RECEIPT] and same.headers.get("x-reef-replayed") == "true"
    assert upstream.stats()["requests"] == 1
    assert record_ids(server, sc) == [first.headers[RECEIPT]]


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_idempotency_key_of_a_cut_stream_reused_with_another_body_is_409(server, upstream, sc, path):
    headers = {"x-reef-scenario": sc, "idempotency-key": f"k-{sc}"}
    upstream.faults({"truncate_after": 2})
    _, events = stream(server, path, body_for(path, "cut short", stream=True), headers)
    first = reef_field(events)["agent_record_id"]
    other = httpx.post(server.url + path, json=body_for(path, "something else"), headers=headers, timeout=30)
    assert other.status_code == 409, other.text
    assert upstream.stats()["requests"] == 1
    assert record_ids(server, sc) == [first]


def test_sdk_retry_of_a_token_count_replays_the_count(server, sc):
    """count_tokens answers are stored as the engine gave them; a retry returns that count, not a chat translation."""
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "count these words"}]}
    headers = {"x-reef-scenario": sc}
    first = httpx.post(server.url + "/v1/messages/count_tokens", json=body, headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    retry = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=30,
                       headers={**headers, "x-stainless-retry-count": "1"})
    assert retry.status_code == 200, retry.text
    assert retry.json() == first.json()
    assert retry.headers[RECEIPT] == first.headers[RECEIPT]
    assert retry.headers.get("x-reef-replayed") == "true"
