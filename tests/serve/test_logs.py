"""Logs of ``reef serve``: ``server.log_format=json`` writes one JSON object a line, with a request line per
request (receipt, scenario, status, timings) and never a body or a token; the ready banner names the URL."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from reef_core.config.schema import ServerConfig
from reef_core.errors import ConfigError
from reef_core.serve.process.logs import JsonFormatter, SafeTextFormatter, check
from reef_core.testing.fixtures import wait_until

TOKEN = "log-test-token-do-not-print"
SECRET = "PINEAPPLE-IN-THE-PROMPT"


def json_lines(text: str) -> list[dict]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def test_json_request_lines_carry_receipt_and_timings_but_no_body_or_token(reef_server, fake_upstream_url):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                         "server.log_format=json", f"server.tokens=[{TOKEN}]")
    answer = httpx.post(f"{server.url}/v1/chat/completions",
                        headers={"authorization": f"Bearer {TOKEN}", "x-reef-scenario": "logged"},
                        json={"model": "m", "messages": [{"role": "user", "content": SECRET}]})
    assert answer.status_code == 200
    receipt = answer.headers["x-reef-agent-record-id"]

    def request_line():
        return next((line for line in json_lines(server.log_path.read_text())
                     if line.get("logger") == "reef.access" and line.get("receipt") == receipt), None)

    wait_until(lambda: request_line() is not None, timeout=30, what="the request's JSON log line")
    line = request_line()
    assert line["scenario"] == "logged" and line["status"] == 200 and line["route"] == "chat"
    assert line["level"] == "info" and line["total_ms"] >= line["engine_ms"] >= 0
    text = server.log_path.read_text()
    assert SECRET not in text and TOKEN not in text
    # Everything but the banner (stdout) is JSON: uvicorn's own lines included.
    others = [l for l in text.splitlines() if l.strip() and not l.startswith("{")]
    assert others and all(l.startswith(("Reef is ready at", "  ")) for l in others), others
    assert f"Reef is ready at {server.url}" in text and f"dashboard        {server.url}/ui" in text


def test_text_is_the_default_and_bad_values_name_their_key():
    assert ServerConfig().log_format == "text"
    with pytest.raises(ConfigError, match="server.log_format"):
        check(ServerConfig(log_format="xml"))
    with pytest.raises(ConfigError, match="server.log_level"):
        check(ServerConfig(log_level="loud"))


def test_json_formatter_keeps_fields_and_exceptions():
    record = logging.LogRecord("reef.access", logging.INFO, __file__, 1, "GET %s", ("/x",), None)
    record.reef = {"route": "/x", "status": 200}
    out = json.loads(JsonFormatter().format(record))
    assert out["message"] == "GET /x" and out["route"] == "/x" and out["status"] == 200 and out["ts"].endswith("Z")


FORGED = "2026-01-01 00:00:00,000 WARNING reef.audit: admin action rollback"


def test_text_log_lines_cannot_be_forged_by_a_client(reef_server, fake_upstream_url):
    # #37 D3: an unauthenticated request whose path (and scenario header) hold a line break wrote that line.
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                         f"server.tokens=[{TOKEN}]")
    forged = FORGED.replace(" ", "%20")
    refused = httpx.get(f"{server.url}/reef/scenarios/x%0a{forged}%0d%1b[2J/status")
    assert refused.status_code == 401
    refused = httpx.get(f"{server.url}/reef/scenarios", headers={"x-reef-scenario": ("x\u2028" + FORGED).encode()})
    assert refused.status_code == 401
    wait_until(lambda: server.log_path.read_text().count("refused GET") >= 2, timeout=30, what="the audit lines")
    lines = server.log_path.read_text().splitlines()
    assert not any(line.startswith(FORGED) for line in lines), lines
    assert not any("\x1b" in line or "\u2028" in line or "\r" in line for line in lines)
    assert any("scenario=x\\n2026-01-01" in line for line in lines), lines  # kept, escaped


def test_text_formatter_escapes_control_characters_in_the_message_and_the_exception():
    formatter = SafeTextFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("reef.audit", logging.WARNING, __file__, 1, "refused scenario=%s", ("a\nb\r\x1b\u2028\x85",),
                               None)
    assert formatter.format(record) == "WARNING refused scenario=a\\nb\\r\\x1b\\u2028\\x85"
    try:
        raise ValueError("bad\nWARNING forged\x1b")
    except ValueError:
        import sys
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = formatter.format(record)
    assert "\x1b" not in text and not any(line.startswith("WARNING forged") for line in text.splitlines())
    assert text.startswith("ERROR failed\nTraceback")  # a traceback keeps its own lines
