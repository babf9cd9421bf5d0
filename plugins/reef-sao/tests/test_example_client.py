"""The example client's concurrent loops and time budget, against `reef serve` in front of the fake upstream."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

_CLIENT = Path(__file__).resolve().parents[1] / "examples" / "client.py"


def _example_client():
    spec = importlib.util.spec_from_file_location("reef_sao_example_client_concurrency", _CLIENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def upstream_reef(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")


def _records(url: str, scenario: str) -> list[dict]:
    return httpx.get(f"{url}/reef/scenarios/{scenario}/records", params={"limit": 100}).json()["records"]


def test_concurrent_loops_each_report_their_own_completion(upstream_reef):
    result = _example_client().run(upstream_reef.url, "client-concurrent", 12, concurrency=4, quiet=True)
    assert len(result["rewards"]) == len(result["times"]) == 12
    assert result["times"] == sorted(result["times"])
    records = _records(upstream_reef.url, "client-concurrent")
    reports = [r for r in records if r["request_type"] == "report"]
    completions = {r["agent_record_id"] for r in records if r["request_type"] != "report"}
    assert len(reports) == 12 and len(completions) == 12
    # Each loop quotes the receipt of its own completion: 12 reports, 12 distinct completions, every one quoted.
    quoted = [ref for r in reports for ref in r["references"]]
    assert len(quoted) == 12 and set(quoted) == completions
    assert sorted(r["score"] for r in reports) == sorted(result["rewards"])
    # each rollout's reply beside its reward, in report order (what a result packet's samples.md shows)
    assert [row["reward"] for row in result["replies"]] == result["rewards"]
    assert all(row["prompt"] and isinstance(row["reply"], str) for row in result["replies"])


def test_duration_budget_stops_an_endless_stream(upstream_reef):
    result = _example_client().run(upstream_reef.url, "client-budget", None, concurrency=2, duration_s=0.5,
                                   quiet=True)
    assert 0 < len(result["rewards"]) == len(result["times"])


def test_bad_arguments_are_refused():
    client = _example_client()
    with pytest.raises(ValueError, match="concurrency"):
        client.run("http://127.0.0.1:9", "s", 1, concurrency=0)
    with pytest.raises(ValueError, match="duration_s"):
        client.run("http://127.0.0.1:9", "s", None)


def test_the_task_sets_its_own_reply_budget_and_the_default_lets_answers_finish(upstream_reef):
    """Issue #37: `+recipe=sao` cut ordinary answers at 24 tokens. Its default is now 256; the example task's requests
    carry the task's own budget (24), and the offline task its `learn.max_tokens`."""
    from reef_core.testing import compose_config
    from reef_sao.tasks import MAX_TOKENS

    assert compose_config(["+recipe=sao"]).engine.max_new_tokens == 256
    assert compose_config(["+recipe=sao"]).learn.max_tokens == MAX_TOKENS == 24
    assert compose_config(["+recipe=sao", "+sao_profile=tiny"]).learn.max_tokens == 8
    _example_client().run(upstream_reef.url, "client-task-budget", 2, quiet=True)
    sent = [r for r in _records(upstream_reef.url, "client-task-budget") if r["request_type"] != "report"]
    assert len(sent) == 2
    for row in sent:
        record = httpx.get(f"{upstream_reef.url}/reef/scenarios/client-task-budget/records/{row['agent_record_id']}")
        assert record.json()["payload"]["request"]["max_tokens"] == MAX_TOKENS
