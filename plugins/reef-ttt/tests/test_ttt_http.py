"""TTT-Discover end to end over HTTP (`reef serve +recipe=ttt +ttt_profile=tiny`): the plan/report/archive contract,
the grid barrier's door through the recipe, learning on the string-scored toy task, and a restart that resumes the
same archive and step."""

from __future__ import annotations

import statistics

import httpx
import pytest

from reef_ttt.client import TTTClient

pytestmark = pytest.mark.slow

STEPS = 30


def _report(server, body, scenario="toy"):
    return httpx.post(f"{server.url}/reef/report", json=body, headers={"x-reef-scenario": scenario})


def test_ttt_learns_over_http_and_resumes_after_a_restart(reef_server):
    server = reef_server("+recipe=ttt", "+ttt_profile=tiny", "engine.seed=0", "seed=0")
    base = f"{server.url}/reef/scenarios/toy/ttt"

    # Before any record: the plan comes from config (step 0, the seeds), and nothing is created.
    plan = httpx.get(f"{base}/plan").json()
    assert plan["step"] == 0 and len(plan["groups"]) == 2 and plan["rollouts_per_group"] == 8
    assert {g["parent_id"] for g in plan["groups"]} == {"seed-0"}
    assert httpx.get(f"{server.url}/reef/scenarios").json()["scenarios"] == []

    client = TTTClient(server.url, "toy")
    results = client.run(STEPS)
    means = [r.mean for r in results]
    first, last = statistics.mean(means[:3]), statistics.mean(means[-3:])
    assert last >= first + 0.1, means

    archive = client.archive(limit=5)
    history = archive["history"]
    assert len(history) == STEPS and all(b >= a for a, b in zip(history, history[1:]))
    assert archive["best"]["score"] == history[-1] > 0.0  # the seed "xyz" scores 0
    assert archive["size"] > 1 and len(archive["entries"]) == 5
    assert archive["entries"][0]["value"] == archive["best"]["score"]
    best_per_step = [r.archive["best"]["score"] for r in results]
    assert best_per_step == history  # the archive each step returned is the one committed with that step

    # Restart: the same archive, the same open step and the same plan.
    plan = client.plan()
    assert plan["step"] == STEPS
    before = client.archive(limit=1000)
    client.close()
    server.restart()
    assert httpx.get(f"{base}/archive", params={"limit": 1000}).json() == before
    assert httpx.get(f"{base}/plan").json()["groups"] == plan["groups"]
    assert httpx.get(f"{base}/plan").json()["step"] == STEPS

    # The door: wrong step, taken slot, out-of-range coordinates, missing state, bad query parameters.
    receipt = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": "toy"},
                         json={"model": "reef", "messages": plan["groups"][0]["prompt"]}).headers[
        "x-reef-agent-record-id"]
    good = {"score": 0.5, "references": [receipt], "metadata": {"step": STEPS, "group": 0, "rollout": 0,
                                                                   "state": "aeiou"}}
    wrong_step = _report(server, {**good, "metadata": {**good["metadata"], "step": STEPS + 1}})
    assert wrong_step.status_code == 400 and "open step" in wrong_step.json()["error"]["message"]
    for bad, field in (({"group": 2}, "metadata.group"), ({"rollout": 8}, "metadata.rollout")):
        reply = _report(server, {**good, "metadata": {**good["metadata"], **bad}})
        assert reply.status_code == 400 and field in reply.json()["error"]["message"]
    no_state = {**good, "metadata": {k: v for k, v in good["metadata"].items() if k != "state"}}
    assert _report(server, no_state).status_code == 400
    assert _report(server, {**good, "score": "high"}).status_code == 400
    assert _report(server, good).status_code == 200
    assert _report(server, {**good, "score": 0.25}).status_code == 409
    assert httpx.get(f"{base}/plan", params={"x": 1}).status_code == 400
    assert httpx.get(f"{base}/archive", params={"limit": "-1"}).status_code == 400
    assert httpx.get(f"{server.url}/reef/scenarios/nope%09/ttt/plan").status_code == 400
    status = httpx.get(f"{server.url}/reef/scenarios/toy/status").json()
    assert status["processor"]["current_step"] == STEPS and status["last_error"] is None


def test_lora_restart_resumes_archive_and_adapter_as_a_pair(reef_server):
    server = reef_server("+recipe=ttt", "+ttt_profile=tiny", "trainer.lora=true", "trainer.lr=2e-2",
                         "engine.seed=0", "seed=0")
    client = TTTClient(server.url, "pair")
    client.run(3)
    before = client.archive(limit=1000)
    client.close()
    server.restart()
    client = TTTClient(server.url, "pair")
    assert client.archive(limit=1000) == before
    result = client.step(3)
    client.close()
    assert result.archive["history"][:3] == before["history"]
    commits = httpx.get(f"{server.url}/reef/scenarios/pair/commits", params={"limit": 100}).json()["commits"]
    last = [c for c in commits if (c.get("metrics") or {}).get("ttt/step") == 3][0]["metrics"]
    # the restored adapter serves and trains: rollouts after the restart come from the policy being trained
    assert last["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and abs(last["approx_kl"]) < 1e-3
    assert last["ttt/kl_to_base"] != 0.0  # and it is not the base any more
