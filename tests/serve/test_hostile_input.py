"""Hostile input of issue #37: every refusal is a 4xx in the route's dialect naming the field, stores nothing and
creates nothing; no input gives a 5xx.

Bodies are sent as raw bytes (httpx would refuse to encode a lone surrogate): ``\\ud800`` is the JSON escape of a
lone surrogate, valid JSON syntax that names no Unicode character.
"""

from __future__ import annotations

import json

import httpx
import pytest

from reef_core.errors import ValidationFailed
from reef_core.observe.model import canonical_bytes, compute_content_hash
from reef_core.serve.errors import error_body
from reef_core.serve.routes.jsonbody import parse_json_object

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
LONE = r"\ud800"  # the six characters of the JSON escape


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")


@pytest.fixture
def sc(request):
    """A scenario of the test's own: a refused request must not create it."""
    return "hostile-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:80]


def post_raw(server, path: str, scenario: str, text: str, headers: list[tuple[str, str]] | None = None):
    sent = [("x-reef-scenario", scenario), ("content-type", "application/json"), *(headers or [])]
    return httpx.post(server.url + path, content=text.encode("ascii"), headers=sent, timeout=60)


def assert_refused_in_dialect(server, response: httpx.Response, path: str, scenario: str, field: str,
                              status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    elif path.startswith("/v1/"):
        assert body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["param"] == field, body
    else:
        assert set(body["error"]) == {"code", "message"}, body
    assert field in body["error"]["message"], body
    # Nothing stored, nothing created.
    records = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records", timeout=30)
    assert records.status_code == 404, records.text
    return body


# -- D1: a lone surrogate, in a value and in a key, on every route that reads a JSON body -------------------------

HELLO_LONE = '[{"role": "user", "content": "a%sb"}]' % LONE
SURROGATE_BODIES = [
    (CHAT, '{"model": "m", "messages": %s}' % HELLO_LONE, "messages[0].content"),
    (CHAT, '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "%s": 1}' % LONE, LONE),
    (MESSAGES, '{"model": "m", "max_tokens": 8, "messages": %s}' % HELLO_LONE, "messages[0].content"),
    (COUNT, '{"model": "m", "messages": %s}' % HELLO_LONE, "messages[0].content"),
    (RESPONSES, '{"model": "m", "input": "x%s"}' % LONE, "input"),
    ("/reef/report", '{"score": 1, "feedback": "%s"}' % LONE, "feedback"),
    ("/reef/train", '{"text": "x", "%s": 1}' % LONE, LONE),
    ("/reef/records", '{"agent_record_id": "r1", "request_type": "inference", "payload": {"request": {"messages": '
                      '%s}, "response": {"choices": []}}}' % HELLO_LONE, "payload.request.messages[0].content"),
    ("/reef/records/batch", '{"records": [{"agent_record_id": "r1", "request_type": "report", '
                            '"payload": {"score": 1, "metadata": {"k%s": 1}}}]}' % LONE,
     "records[0].payload.metadata.k" + LONE),
]


@pytest.mark.parametrize("path,text,field", SURROGATE_BODIES,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f[:12]}" for p, _, f in SURROGATE_BODIES])
def test_lone_surrogate_is_400_naming_the_field(server, upstream, sc, path, text, field):
    assert_refused_in_dialect(server, post_raw(server, path, sc, text), path, sc, field)
    assert upstream.stats()["requests"] == 0


def test_lone_surrogate_with_a_receipt_and_idempotency_key_is_400(server, upstream, sc):
    # The idempotency digest is computed over the body: refused before it.
    body = '{"model": "m", "messages": %s}' % HELLO_LONE
    response = post_raw(server, CHAT, sc, body, [("x-reef-agent-record-id", "rid-1"), ("idempotency-key", "k-1")])
    assert_refused_in_dialect(server, response, CHAT, sc, "messages[0].content")


def test_raw_surrogate_bytes_are_400_naming_the_field(server, sc):
    # UTF-8-encoded surrogate code points (CESU-8 style) are no valid UTF-8 either.
    raw = b'{"score": 1, "feedback": "\xed\xa0\x80"}'
    response = httpx.post(server.url + "/reef/report", content=raw, timeout=60,
                          headers={"x-reef-scenario": sc, "content-type": "application/json"})
    assert_refused_in_dialect(server, response, "/reef/report", sc, "feedback")


def test_surrogate_pairs_are_ordinary_text(server, sc):
    body = '{"model": "m", "messages": [{"role": "user", "content": "crab \\ud83e\\udd80"}]}'
    response = post_raw(server, CHAT, sc, body)
    assert response.status_code == 200, response.text


def test_sites_behind_the_door_never_fail_on_a_lone_surrogate():
    # Digests and error bodies are reached by strings that did not come through a request body too.
    with pytest.raises(ValidationFailed, match="lone surrogate"):
        compute_content_hash("report", "s", {"feedback": "\ud800"}, [])
    with pytest.raises(ValidationFailed, match="lone surrogate"):
        canonical_bytes({"\ud800": 1})
    for dialect in ("openai", "anthropic", "reef"):
        body = error_body(dialect, 400, "unknown field \ud800", param="\ud800")
        assert "\\ud800" in json.dumps(body, ensure_ascii=False).encode("utf-8").decode()
    with pytest.raises(ValidationFailed) as refused:
        parse_json_object(b'{"a": [1, {"b\\udc00": 2}]}')
    assert refused.value.param == "a[1].b\\udc00"
    assert parse_json_object(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash, then text


# -- D2: an import's payload.dialect of the wrong type --------------------------------------------------------------

@pytest.mark.parametrize("dialect", ['{"a": 1}', "[1]", "5", "null"])
def test_import_dialect_of_the_wrong_type_is_400(server, sc, dialect):
    text = ('{"agent_record_id": "r1", "request_type": "inference", "payload": {"request": {"messages": '
            '[{"role": "user", "content": "hi"}]}, "response": {"choices": []}, "dialect": %s}}' % dialect)
    assert_refused_in_dialect(server, post_raw(server, "/reef/records", sc, text), "/reef/records", sc,
                              "record.payload.dialect")
    batch = '{"records": [%s]}' % text
    assert_refused_in_dialect(server, post_raw(server, "/reef/records/batch", sc, batch), "/reef/records/batch", sc,
                              "records[0].payload.dialect")


@pytest.mark.parametrize("path,text,field", [
    ("/reef/records", '{"agent_record_id": "r1", "request_type": "inference", "payload": {"request": {"messages": '
                      '[{"role": "user", "content": "hi"}]}, "response": {"choices": [{"message": "x"}]}}}',
     "record.payload"),
    (RESPONSES, '{"model": "m", "input": [{"type": "message", "role": {"a": 1}, "content": "hi"}]}', "input[0].role"),
], ids=["import-message-not-an-object", "responses-role-an-object"])
def test_objects_where_strings_belong_are_400(server, sc, path, text, field):
    assert_refused_in_dialect(server, post_raw(server, path, sc, text), path, sc, field)


# -- D6: two x-reef-scenario headers that disagree -----------------------------------------------------------------

CHAT_BODY = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize("path,text", [
    (CHAT, CHAT_BODY),
    (MESSAGES, '{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}'),
    ("/reef/report", '{"score": 1}'),
    ("/reef/records", '{"agent_record_id": "r1", "request_type": "report", "payload": {"score": 1}}'),
])
def test_disagreeing_scenario_headers_are_400(server, upstream, sc, path, text):
    other = sc + "-other"
    response = post_raw(server, path, sc, text, [("x-reef-scenario", other)])
    assert_refused_in_dialect(server, response, path, sc, "x-reef-scenario", status=400)
    assert httpx.get(f"{server.url}/reef/scenarios/{other}/records", timeout=30).status_code == 404
    assert upstream.stats()["requests"] == 0


def test_disagreeing_scenario_headers_on_a_read_are_400(server, sc):
    response = httpx.get(f"{server.url}/reef/harness", headers=[("x-reef-scenario", sc), ("x-reef-scenario", "b")],
                         timeout=30)
    assert response.status_code == 400, response.text
    assert "x-reef-scenario" in response.json()["error"]["message"]


def test_repeated_identical_scenario_headers_are_one(server, sc):
    response = post_raw(server, CHAT, sc, CHAT_BODY, [("x-reef-scenario", sc)])
    assert response.status_code == 200, response.text


# -- D8: a provider 503 is relayed with its Retry-After --------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_provider_503_is_relayed_with_retry_after(server, upstream, sc, path, stream):
    upstream.faults({"status": 503, "retry_after": 7})
    text = '{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": %s}' % (
        "true" if stream else "false")
    response = post_raw(server, path, sc, text)
    assert response.status_code == 503, response.text
    assert response.headers.get("retry-after") == "7"
    body = response.json()
    if path == MESSAGES:
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
    else:
        assert body["error"]["type"] == "server_error", body
    assert httpx.get(f"{server.url}/reef/scenarios/{sc}/records", timeout=30).status_code == 404


def test_provider_500_stays_502_without_retry_after(server, upstream, sc):
    upstream.faults({"status": 500, "retry_after": 7})
    response = post_raw(server, CHAT, sc, CHAT_BODY)
    assert response.status_code == 502, response.text
    assert "retry-after" not in response.headers


# -- D9: a stream cut by the provider ends with a stable message and code ------------------------------------------

def _events(response: httpx.Response) -> list[tuple[str | None, object]]:
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            out.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return out


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
def test_a_cut_stream_ends_with_a_stable_error(server, upstream, sc, path):
    upstream.faults({"reset_after_events": 2})
    text = ('{"model": "m", "max_tokens": 8, "input": "a stream that breaks", "stream": true}' if path == RESPONSES
            else '{"model": "m", "max_tokens": 8, "stream": true, '
                 '"messages": [{"role": "user", "content": "a stream that breaks midway"}]}')
    response = post_raw(server, path, sc, text)
    assert response.status_code == 200
    _, last = _events(response)[-1]
    error = last["error"] if "error" in last and isinstance(last["error"], dict) else last
    assert error["message"] == "the provider connection broke off mid-stream", last
    assert error.get("code", "upstream_error") == "upstream_error", last
    # The HTTP client's exception never reaches the client, nor the record.
    for leaked in ("aiohttp", "ClientPayloadError", "TransferEncodingError", "Not enough data", "ServerDisconnected"):
        assert leaked not in response.text
    receipt = (last.get("reef") or {}).get("agent_record_id") or last["response"]["id"].removeprefix("resp_")
    record = httpx.get(f"{server.url}/reef/scenarios/{sc}/records/{receipt}", timeout=30).json()
    assert record["complete"] is False
    assert record["payload"]["error"] == "the provider connection broke off mid-stream"
