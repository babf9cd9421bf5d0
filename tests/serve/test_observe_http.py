"""Reports become samples through the scenario's processor, observed over real HTTP."""

from __future__ import annotations

import httpx
import pytest

from reef_core.testing.fixtures import wait_until


@pytest.fixture
def server(reef_server, fake_upstream_url):
    # The record-only recipe with a per-report processor and no trainer: samples wait for inspection.
    return reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                       "recipe.processor=per_report", "+recipe.processor_options.batch_size=100")


def chat(server, scenario, messages):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": scenario},
                          json={"model": "m", "messages": messages})
    assert response.status_code == 200
    return response.headers["x-reef-agent-record-id"], response.json()["choices"][0]["message"]


def samples(server, scenario):
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/samples").json()["samples"]


def test_three_receipts_make_one_three_turn_sample(server):
    history = [{"role": "user", "content": "turn one"}]
    receipts = []
    for text in ("turn two", "turn three", None):
        receipt, reply = chat(server, "agent", history)
        receipts.append(receipt)
        history = history + [{"role": "assistant", "content": reply["content"]}]
        if text:
            history.append({"role": "user", "content": text})
    report = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": "agent"},
                        json={"score": 1.0, "references": receipts})
    assert report.status_code == 200
    [sample] = wait_until(lambda: samples(server, "agent"))
    assert sample["turns"] == 3 and sample["reward"] == 1.0
    assert sample["source_ids"] == receipts + [report.json()["agent_record_id"]]
    assert [m["content"] for m in sample["messages"]] == [
        "turn one", "echo: turn one", "turn two", "echo: turn two", "turn three", "echo: turn three"]
    status = httpx.get(f"{server.url}/reef/scenarios/agent/status").json()
    assert status["processor"]["pending_units"] == 1


def test_repeated_report_for_the_same_receipt_counts_a_duplicate(server):
    receipt, _ = chat(server, "dups", [{"role": "user", "content": "q"}])
    for _ in range(2):
        assert httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": "dups"},
                          json={"score": 0.5, "references": [receipt]}).status_code == 200
    status = wait_until(lambda: (s := httpx.get(f"{server.url}/reef/scenarios/dups/status").json())
                      ["processor"]["records_ingested"] >= 3 and s)
    assert status["processor"]["pending_units"] == 1
    assert status["processor"]["dropped"] == {"duplicate": 1}
