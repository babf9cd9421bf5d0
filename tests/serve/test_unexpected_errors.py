"""An unexpected exception (a Reef bug) is a 500 in the route's dialect carrying an error id that the log line
also carries; the keep-alive connection survives it, and a stream whose headers already left ends with an error
event instead of a cut connection.

The server runs in this process (uvicorn in a thread) so a test can make one of its parts fail on purpose.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
from urllib.parse import urlparse

import httpx
import pytest

from reef_core.engines.base import StreamEvent

ERROR_ID = re.compile(r"err_[0-9a-f]{16}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, fake_upstream_url):
    """``(url, deployment)`` of an in-process server on the upstream engine."""
    from reef_core.config import compose_config
    from reef_core.loop.assemble import build_deployment
    from reef_core.plugins import get_plugin_manager
    from reef_core.serve.app import create_app
    from reef_core.testing.fake_upstream import serve_asgi

    pm = get_plugin_manager()
    data_dir = tmp_path_factory.mktemp("unexpected")
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={data_dir}"], pm)
    deployment = build_deployment(cfg, pm)
    with serve_asgi(create_app(deployment), lifespan="on") as url:
        yield url, deployment


@pytest.fixture
def connection(served):
    """One keep-alive HTTP/1.1 connection to the server."""
    parts = urlparse(served[0])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    yield conn
    conn.close()


def send(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None,
         scenario: str = "unexpected") -> tuple[int, dict, bytes]:
    headers = {"x-reef-scenario": scenario, "content-type": "application/json"}
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def boom(*args, **kwargs):
    raise RuntimeError("a bug on purpose")


def logged_ids(caplog) -> set[str]:
    return {m for r in caplog.records if r.exc_info for m in ERROR_ID.findall(r.getMessage())}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_inference_bug_is_a_500_in_dialect_with_logged_id(served, connection, monkeypatch, caplog, path):
    url, deployment = served
    monkeypatch.setattr(deployment.engine, "complete", boom)
    caplog.set_level(logging.ERROR, logger="reef.serve")
    status, _, raw = send(connection, "POST", path, {"model": "m", "max_tokens": 8,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert status == 500, raw
    body = json.loads(raw)
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "api_error", body
    else:
        assert body["error"]["type"] == "server_error", body
    error_id = ERROR_ID.search(body["error"]["message"]).group()
    assert error_id in logged_ids(caplog)
    monkeypatch.undo()
    status, _, raw = send(connection, "POST", path, {"model": "m", "max_tokens": 8,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, raw  # same connection, still open


def test_route_bug_keeps_the_connection(served, connection, monkeypatch, caplog):
    url, deployment = served
    monkeypatch.setattr(deployment.store, "scenarios", boom)
    caplog.set_level(logging.ERROR, logger="reef.serve")
    status, _, raw = send(connection, "GET", "/reef/scenarios")
    assert status == 500, raw
    body = json.loads(raw)
    assert body["error"]["code"] == "internal_error"
    assert ERROR_ID.search(body["error"]["message"]).group() in logged_ids(caplog)
    monkeypatch.undo()
    status, _, raw = send(connection, "GET", "/healthz")  # http.client raises if the server hung up
    assert status == 200, raw


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_stream_bug_after_headers_ends_with_an_error_event(served, monkeypatch, caplog, path):
    url, deployment = served

    async def failing_stream(request):
        yield StreamEvent(None, {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "half"},
                                              "finish_reason": None}]})
        raise RuntimeError("a bug on purpose")

    monkeypatch.setattr(deployment.engine, "stream", failing_stream)
    caplog.set_level(logging.ERROR, logger="reef.serve")
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + path, headers={"x-reef-scenario": "unexpected-stream"},
                           json={"model": "m", "max_tokens": 8, "stream": True,
                                 "messages": [{"role": "user", "content": "hi"}]}) as response:
            assert response.status_code == 200
            text = response.read().decode()  # httpx raises RemoteProtocolError on a cut stream
        data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        error = data[-1]
        assert "error" in error and error["reef"]["complete"] is False, text
        assert ERROR_ID.search(error["error"]["message"]).group() in logged_ids(caplog)
        record = client.get(f"{url}/reef/scenarios/unexpected-stream/records/{error['reef']['agent_record_id']}")
        assert record.status_code == 200 and record.json()["complete"] is False
