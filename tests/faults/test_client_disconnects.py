"""A client that goes away mid-request, against a real `reef serve` over loopback.

What was generated is recorded, as incomplete with the reason ``client_disconnected`` (so it never trains), whether
the client left a stream midway, before its first event, or while waiting for a plain answer; and a retry of such a
request runs again. The client is a raw socket closed mid-request; the provider is FakeUpstream, told to answer
slowly; the test then polls the records route (bounded) until the record appears.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from reef_core.testing.fixtures import wait_until

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
LONG_TEXT = " ".join(f"word{i}" for i in range(40))


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url):
    # A generous provider timeout: the slow answers below must outlast the client, not the engine.
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                              "engine.timeout_s=60")


@pytest.fixture(autouse=True)
def _provider_settles(upstream):
    # The fake keeps sleeping through a delay after Reef hung up: let it finish before counters are reset.
    yield
    wait_until(lambda: upstream.stats()["in_flight"] == 0, timeout=30)


def body_for(path: str, text: str, **extra) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    if path == MESSAGES:
        body["max_tokens"] = 64
    return body


def send_request(server, path: str, body: dict, headers: dict) -> socket.socket:
    """Send one HTTP/1.1 request on a raw socket and return the socket (the response is left unread)."""
    data = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in headers.items())]
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    """Read from ``sock`` until ``marker`` arrived (bounded by the socket timeout)."""
    received = b""
    while marker not in received:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {marker!r}: {received!r}"
        received += chunk
    return received


def records(server, scenario: str) -> list[dict]:
    response = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records", timeout=30)
    return response.json()["records"] if response.status_code == 200 else []


def detail(server, scenario: str, record_id: str) -> dict:
    """One record with its payload (the list route leaves payloads out)."""
    response = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{record_id}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def the_record(server, scenario: str) -> dict:
    """Wait (bounded) for the scenario's first record and return it, payload included."""
    first = wait_until(lambda: records(server, scenario), timeout=30)[0]
    return detail(server, scenario, first["agent_record_id"])


def response_text(path: str, record: dict) -> str:
    response = record["payload"]["response"] or {}
    if record["payload"]["dialect"] == "openai":
        return "".join(c["message"]["content"] or "" for c in response.get("choices") or ())
    return "".join(b.get("text", "") for b in response.get("content") or ())


def assert_disconnected(record: dict) -> None:
    assert record["complete"] is False, record
    assert record["payload"]["error"] == "client_disconnected", record["payload"]


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_client_leaving_a_stream_midway_leaves_an_incomplete_record(server, upstream, scenario, path):
    upstream.faults({"chunk_delay_s": 0.1})  # about four seconds for the whole answer
    sock = send_request(server, path, body_for(path, LONG_TEXT, stream=True), {"x-reef-scenario": scenario})
    read_until(sock, b"word1")  # a few words in
    sock.close()
    record = the_record(server, scenario)
    assert_disconnected(record)
    text = response_text(path, record)
    assert text.startswith("echo: word0") and "word39" not in text  # what was generated before the client left
    assert len(records(server, scenario)) == 1


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_client_leaving_before_the_first_stream_event_leaves_an_incomplete_record(server, upstream, scenario, path):
    upstream.faults({"delay_s": 3})
    sock = send_request(server, path, body_for(path, "slow to start", stream=True), {"x-reef-scenario": scenario})
    wait_until(lambda: upstream.stats()["in_flight"] == 1, timeout=30)
    sock.close()
    assert_disconnected(the_record(server, scenario))


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_client_leaving_before_a_plain_answer_leaves_an_incomplete_record(server, upstream, scenario, path):
    upstream.faults({"delay_s": 3})
    key = f"k-{scenario}"
    body = body_for(path, "slow answer")
    sock = send_request(server, path, body, {"x-reef-scenario": scenario, "idempotency-key": key})
    wait_until(lambda: upstream.stats()["in_flight"] == 1, timeout=30)
    sock.close()
    first = the_record(server, scenario)
    assert_disconnected(first)
    # Its receipt never reached the client, so a retry runs again and gets a record of its own.
    retry = httpx.post(server.url + path, json=body, headers={"x-reef-scenario": scenario, "idempotency-key": key},
                       timeout=30)
    assert retry.status_code == 200, retry.text
    receipt = retry.headers["x-reef-agent-record-id"]
    assert receipt != first["agent_record_id"] and "x-reef-replayed" not in retry.headers
    second = detail(server, scenario, receipt)
    assert second["complete"] is True and second["payload"]["retry_of"] == first["agent_record_id"]
