"""SAO end to end through `reef serve +recipe=sao` over HTTP with the tiny model: it learns."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import httpx
import pytest

from reef_core.testing import learn_in_rounds

pytestmark = pytest.mark.slow

_CLIENT = Path(__file__).resolve().parents[1] / "examples" / "client.py"


def _example_client():
    spec = importlib.util.spec_from_file_location("reef_sao_example_client", _CLIENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sao_learns_over_http(reef_server):
    server = reef_server("+recipe=sao", "+sao_profile=tiny", "engine.seed=0", "seed=0")
    # Ten rounds of 48, the learner idle after each: learning per rollout, not per second of a busy machine.
    rewards = learn_in_rounds(_example_client().run, server.url, "vowels")
    assert len(rewards) == 480
    first, last = statistics.mean(rewards[:48]), statistics.mean(rewards[-48:])
    assert last >= 0.2 and last - first >= 0.1, (first, last)

    releases = httpx.get(f"{server.url}/reef/scenarios/vowels/releases").json()["releases"]
    trained = [r for r in releases if r["operation"] == "training"]
    assert len(trained) >= 10
    for row in trained[:3]:
        assert row["evaluation"] is not None and row["metrics"]["batch_size"] == 4
        assert "reward_mean" in row["metrics"] or any(k.endswith("reward_mean") for k in row["metrics"])
    commits = httpx.get(f"{server.url}/reef/scenarios/vowels/commits", params={"limit": 100}).json()["commits"]
    assert all(c["decision"]["decision"] == "select" for c in commits if c.get("decision"))
    status = httpx.get(f"{server.url}/reef/scenarios/vowels/status").json()
    assert status["last_error"] is None and status["counters"]["selected"] >= 10
