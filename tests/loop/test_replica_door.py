"""A serving replica (``server.learner=false``) trains nothing but applies its recipe's door rule on reports."""

from __future__ import annotations

import httpx

GRID = ["recipe.processor=grid", "+recipe.processor_options.groups=2", "+recipe.processor_options.rollouts_per_group=2"]


def test_a_replica_refuses_what_the_learner_would_and_names_where_training_runs(reef_server, fake_upstream_url):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *GRID,
                         "server.learner=false")
    sc = "door"
    receipt = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": sc},
                         json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).headers[
        "x-reef-agent-record-id"]

    def report(score, group, rollout):
        return httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": sc},
                          json={"score": score, "references": [receipt],
                                "metadata": {"step": 0, "group": group, "rollout": rollout}})

    bad = report(1.0, 2, 0)
    assert bad.status_code == 400 and "metadata.group" in bad.json()["error"]["message"]
    assert report(1.0, 0, 0).status_code == 200
    assert report(0.0, 0, 0).status_code == 409  # the slot's key is taken, as on a learner-bearing server
    status = httpx.get(f"{server.url}/reef/scenarios/{sc}/status").json()
    assert status["learner"] == "elsewhere"
