"""Bad request bodies and query parameters get a 400 in the route's dialect naming the field: never a 500,
a 502 or a dropped connection, and nothing is stored for them.

Driven over HTTP against `reef serve` processes: the upstream engine (FakeUpstream speaking OpenAI, so
Anthropic bodies go through translation), the embedded tiny model, and a harness recipe (GEPA). Raw httpx
sends what the SDKs would refuse to.
"""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def upstream_server(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")


@pytest.fixture
def sc(request):
    """A scenario of the test's own: a refused request must not create it."""
    return "bad-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:80]


def post(server, path: str, scenario: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"x-reef-scenario": scenario, "content-type": "application/json"}, **kw)


def assert_refused(server, response: httpx.Response, path: str, scenario: str, field: str, param: bool = True) -> str:
    """A 400 in ``path``'s dialect whose message (and OpenAI ``param``, unless ``param=False``: an error about the
    whole body) names ``field``; nothing was stored."""
    assert response.status_code == 400, response.text
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    elif path.startswith("/v1/"):
        assert body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["param"] == (field if param else None), body
    else:
        assert set(body["error"]) == {"code", "message"}, body
    assert field in body["error"]["message"], body
    records = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records", timeout=30)
    assert records.status_code == 404 or records.json()["records"] == [], records.text
    return body["error"]["message"]


# -- Anthropic bodies translated for an OpenAI engine ----------------------------------------------------------

ANTHROPIC_BAD = [
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"tools": "x"}, "tools"),
    ({"stop_sequences": 5}, "stop_sequences"),
    ({"metadata": "x"}, "metadata"),
]


@pytest.mark.parametrize("path", [MESSAGES, COUNT])
@pytest.mark.parametrize("bad,field", ANTHROPIC_BAD, ids=[f for _, f in ANTHROPIC_BAD])
def test_anthropic_wrong_types_are_400_naming_the_field(upstream_server, sc, path, bad, field):
    body = {"model": "m", "max_tokens": 16, "messages": HELLO, **bad}
    assert_refused(upstream_server, post(upstream_server, path, sc, body), path, sc, field)


OPENAI_BAD = [
    ({"messages": 5}, "messages"),
    ({"seed": 2**70}, "seed"),
    ({"stop": 5}, "stop"),
    ({"tools": "x"}, "tools"),
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
]


@pytest.mark.parametrize("bad,field", OPENAI_BAD, ids=[f for _, f in OPENAI_BAD])
def test_openai_wrong_types_are_400_naming_the_param(upstream_server, upstream, sc, bad, field):
    body = {"model": "m", "messages": HELLO, **bad}
    assert_refused(upstream_server, post(upstream_server, CHAT, sc, body), CHAT, sc, field)
    assert upstream.stats()["requests"] == 0  # refused at the door, not by the provider


# -- JSON nesting and numbers beyond 64 bits -----------------------------------------------------------------

def _nested(depth: int) -> str:
    return '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "extra": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize("path", [CHAT, MESSAGES, COUNT, "/reef/report"])
@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_400(upstream_server, sc, path, depth):
    response = post(upstream_server, path, sc, _nested(depth))
    assert_refused(upstream_server, response, path, sc, "nested deeper than 64 levels", param=False)


def test_nesting_within_the_limit_is_served(upstream_server, sc):
    response = post(upstream_server, CHAT, sc, _nested(60))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("param", ["after_sequence", "limit"])
def test_records_query_integers_beyond_64_bits_are_400(upstream_server, sc, param):
    assert post(upstream_server, CHAT, sc, {"model": "m", "messages": HELLO}).status_code == 200
    response = httpx.get(f"{upstream_server.url}/reef/scenarios/{sc}/records", params={param: 2**70}, timeout=30)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]


def test_commits_after_step_beyond_64_bits_is_400(upstream_server, sc):
    assert post(upstream_server, CHAT, sc, {"model": "m", "messages": HELLO}).status_code == 200
    response = httpx.get(f"{upstream_server.url}/reef/scenarios/{sc}/commits", params={"after_step": 2**70},
                         timeout=30)
    assert response.status_code == 400, response.text
    assert "after_step" in response.json()["error"]["message"]


@pytest.mark.parametrize("score", ["1" + "0" * 400, "-1" + "0" * 400, "1e400", "NaN", "Infinity"])
def test_report_score_beyond_float_range_is_400(upstream_server, sc, score):
    response = post(upstream_server, "/reef/report", sc, '{"score": %s}' % score)
    assert_refused(upstream_server, response, "/reef/report", sc, "score" if score[-1] == "0" else "JSON")


# -- provider errors relayed with their status and retry-after, plain and streamed ------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_provider_429_keeps_retry_after(upstream_server, upstream, sc, path, stream):
    upstream.faults({"status": 429, "retry_after": 7})
    response = post(upstream_server, path, sc, {"model": "m", "max_tokens": 16, "messages": HELLO, "stream": stream})
    assert response.status_code == 429, response.text
    assert response.headers.get("retry-after") == "7"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_provider_413_stays_413(upstream_server, upstream, sc, path, stream):
    upstream.faults({"status": 413})
    response = post(upstream_server, path, sc, {"model": "m", "max_tokens": 16, "messages": HELLO, "stream": stream})
    assert response.status_code == 413, response.text
    body = response.json()
    if path == MESSAGES:
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large", body
    else:
        assert body["error"]["type"] == "invalid_request_error", body


# -- the local engine: client errors are 400, not 500 or 502 ---------------------------------------------------

@pytest.fixture(scope="module")
def local_server(module_reef_server):
    return module_reef_server("engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=4", "engine.seed=0")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("bad,field", [({"stop": 5}, "stop"), ({"seed": 2**70}, "seed"), ({"tools": "x"}, "tools"),
                                       ({"temperature": 1e308 * 10}, "temperature")],
                         ids=["stop", "seed", "tools", "temperature"])
def test_local_engine_client_errors_are_400(local_server, sc, bad, field, stream):
    body = json.dumps({"model": "tiny", "messages": HELLO, "stream": stream, **bad}).replace("Infinity", "1e400")
    assert_refused(local_server, post(local_server, CHAT, sc, body), CHAT, sc, field)


def test_local_engine_64_bit_seed_is_served(local_server, sc):
    response = post(local_server, CHAT, sc, {"model": "tiny", "messages": HELLO, "seed": 2**63 - 1})
    assert response.status_code == 200, response.text


# -- a harness surface shapes only valid bodies ----------------------------------------------------------------

def test_harness_surface_refuses_messages_that_are_not_a_list(reef_server, fake_upstream_url, sc):
    server = reef_server("+recipe=gepa", "engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")
    assert post(server, CHAT, "warm", {"model": "m", "messages": HELLO}).status_code == 200
    assert_refused(server, post(server, CHAT, sc, {"model": "m", "messages": 5}), CHAT, sc, "messages")
    assert_refused(server, post(server, MESSAGES, sc, {"model": "m", "max_tokens": 8, "messages": 5}),
                   MESSAGES, sc, "messages")
