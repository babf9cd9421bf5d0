"""The ``grid`` processor behind a real ``reef serve``: slots refused at the door, the barrier, restarts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from reef_core.testing.fixtures import wait_until

GRID = ["recipe.processor=grid", "+recipe.processor_options.groups=2", "+recipe.processor_options.rollouts_per_group=2"]


def infer(server, scenario, text):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": scenario},
                          json={"model": "m", "messages": [{"role": "user", "content": text}]})
    assert response.status_code == 200, response.text
    return response.headers["x-reef-agent-record-id"]


def report(server, scenario, receipt, score, step, group, rollout, **extra):
    body = {"score": score, "references": [receipt],
            "metadata": {"step": step, "group": group, "rollout": rollout, **extra}}
    return httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario}, json=body)


def reports(server, scenario):
    rows = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records").json()["records"]
    return [r for r in rows if r["request_type"] == "report"]


def processor(server, scenario):
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/status").json()["processor"]


def test_grid_slots_are_guarded_at_the_door_and_a_step_waits_for_its_last_slot(reef_server, fake_upstream_url,
                                                                               store_overrides):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *GRID,
                         *store_overrides)
    scenario = "ttt"
    receipts = {(g, r): infer(server, scenario, f"group {g} rollout {r}") for g in range(2) for r in range(2)}

    # Bad coordinates are 400s naming the field, and store nothing.
    for extra, field in (({"group": 2}, "metadata.group"), ({"rollout": -1}, "metadata.rollout"),
                         ({"groups_per_step": 3}, "metadata.groups_per_step")):
        coords = {"step": 0, "group": 0, "rollout": 0} | extra
        response = report(server, scenario, receipts[(0, 0)], 1.0, coords.pop("step"), coords.pop("group"),
                          coords.pop("rollout"), **coords)
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"]
    assert reports(server, scenario) == []

    first = report(server, scenario, receipts[(0, 0)], 0.0, 0, 0, 0)
    assert first.status_code == 200, first.text
    # Another report for a taken slot is a 409 and stores nothing; resending the same report is a retry.
    taken = report(server, scenario, receipts[(0, 1)], 1.0, 0, 0, 0)
    assert taken.status_code == 409 and "reef-grid/0/0/0" in taken.json()["error"]["message"]
    again = report(server, scenario, receipts[(0, 0)], 0.0, 0, 0, 0)
    assert again.status_code == 200 and again.json()["agent_record_id"] == first.json()["agent_record_id"]
    assert len(reports(server, scenario)) == 1

    for (g, r), score in (((0, 1), 1.0), ((1, 0), 2.0)):
        assert report(server, scenario, receipts[(g, r)], score, 0, g, r).status_code == 200
    # Racing reports for one slot: exactly one is stored, whatever the interleaving.
    spare = infer(server, scenario, "step 1")
    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(lambda i: report(server, scenario, spare, float(i), 1, 0, 0).status_code, range(8)))
    assert sorted(codes) == [200] + [409] * 7
    status = wait_until(lambda: (s := processor(server, scenario))["records_ingested"] == 9 and s, timeout=30)
    assert not status["ready"] and status["steps"] == {"0": 3, "1": 1}  # slots missing: the steps wait

    server.restart()
    # The slot keys are durable: a taken slot is still a 409 after the restart.
    assert report(server, scenario, receipts[(1, 1)], 3.0, 0, 0, 1).status_code == 409
    assert report(server, scenario, receipts[(1, 1)], 3.0, 0, 1, 1).status_code == 200
    status = wait_until(lambda: (s := processor(server, scenario))["ready"] and s, timeout=30)
    assert status["complete_steps"] == 1 and status["dropped"] == {}
    samples = httpx.get(f"{server.url}/reef/scenarios/{scenario}/samples").json()["samples"]
    assert [(s["metadata"]["reef"]["grid"]["group"], s["metadata"]["reef"]["grid"]["rollout"], s["reward"])
            for s in samples[:4]] == [(0, 0, 0.0), (0, 1, 1.0), (1, 0, 2.0), (1, 1, 3.0)]
    assert len(reports(server, scenario)) == 5
