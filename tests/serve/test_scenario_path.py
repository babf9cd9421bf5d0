"""``/s/{scenario}/...`` (#37 first use 10): a client that cannot send ``x-reef-scenario`` names it in the URL."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")


def _records(server, scenario: str) -> list[dict]:
    answer = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records")
    return answer.json()["records"] if answer.status_code == 200 else []


def test_stock_sdks_with_only_a_base_url_reach_their_scenario(server):
    chat = openai.OpenAI(base_url=f"{server.url}/s/stock-app/v1", api_key="none")
    raw = chat.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}])
    receipt = raw.headers["x-reef-agent-record-id"]
    messages = anthropic.Anthropic(base_url=f"{server.url}/s/stock-app", api_key="none")
    messages.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hello"}])
    report = httpx.post(f"{server.url}/s/stock-app/reef/report", json={"score": 1, "references": [receipt]})
    assert report.status_code == 200, report.text
    kinds = [r["request_type"] for r in _records(server, "stock-app")]
    assert kinds == ["inference", "inference", "report"]


def test_an_encoded_name_is_one_segment_and_a_disagreeing_header_is_refused(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    spaced = httpx.post(f"{server.url}/s/two%20words/v1/chat/completions", json=body)
    assert spaced.status_code == 200, spaced.text
    assert len(_records(server, "two words")) == 1
    same = httpx.post(f"{server.url}/s/agree/v1/chat/completions", json=body, headers={"x-reef-scenario": "agree"})
    assert same.status_code == 200, same.text
    other = httpx.post(f"{server.url}/s/path-name/v1/chat/completions", json=body,
                       headers={"x-reef-scenario": "header-name"})
    assert other.status_code == 400 and "x-reef-scenario" in other.text
    assert _records(server, "path-name") == [] and _records(server, "header-name") == []
    bad = httpx.post(f"{server.url}/s/%FF/v1/chat/completions", json=body)  # not UTF-8: refused at the door
    assert bad.status_code == 400, bad.text
    assert httpx.post(f"{server.url}/s/", json=body).status_code == 404
