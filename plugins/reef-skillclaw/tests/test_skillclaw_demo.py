"""The SkillClaw demo over HTTP (issue #17's acceptance): 3 categories x 5 tasks, 4 days, method and frozen control.

A whole Reef server (``+recipe=skillclaw``) in front of the deterministic agent; sessions driven through Reef with
the official ``openai`` SDK; one report per graded session quoting all of its receipts; the deterministic evolver
runs the nights.
"""

from __future__ import annotations

import httpx

from reef_core.api import CATALOG_OPEN
from reef_skillclaw.examples import CATEGORIES, LEARNABLE, TASKS_PER_CATEGORY
from reef_skillclaw.examples.demo import CONTROL, METHOD, UNSCORED_TASKS, control_band, run_days, serve_demo

DAYS = 4


def _records(url: str, scenario: str) -> list[dict]:
    rows, after = [], 0
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            page = client.get(f"/reef/scenarios/{scenario}/records",
                              params={"after_sequence": after, "limit": 100}).json()
            rows += page["records"]
            if page["next_after_sequence"] is None:
                return rows
            after = page["next_after_sequence"]




def test_pool_grows_from_graded_sessions_and_beats_the_frozen_control(tmp_path):
    with serve_demo(tmp_path) as url:
        history = run_days(url, DAYS, log=lambda line: None)
        method_records = _records(url, METHOD)
        control_records = _records(url, CONTROL)
        # The catalog is in every recorded request payload (the request as the engine received it), exactly once.
        with httpx.Client(base_url=url, timeout=30) as client:
            for scenario, rows in ((METHOD, method_records), (CONTROL, control_records)):
                for row in rows:
                    if row["request_type"] != "inference":
                        continue
                    payload = client.get(f"/reef/scenarios/{scenario}/records/{row['agent_record_id']}").json()
                    system = payload["payload"]["request"]["messages"][0]
                    assert system["role"] == "system" and system["content"].count(CATALOG_OPEN) == 1
        reports = [r for r in method_records if r["request_type"] == "report"]

    sessions = len(CATEGORIES) * TASKS_PER_CATEGORY
    assert len(reports) == DAYS * sessions and not [r for r in control_records if r["request_type"] == "report"]
    # One report per session quoting all of its receipts: 2 or 3 turns, 1 for the session whose harness crashed.
    assert {len(r["references"]) for r in reports if r["score"] is not None} <= {2, 3}
    assert {len(r["references"]) for r in reports if r["score"] is None} == {1}
    assert sum(len(r["references"]) for r in reports) == len([r for r in method_records
                                                              if r["request_type"] == "inference"])
    unscored = [r for r in reports if r["score"] is None]
    assert len(unscored) == DAYS * len(UNSCORED_TASKS)

    # One commit per night; each night that changed the pool published exactly one release.
    nights = history["nights"]
    assert len(nights) == DAYS
    published = [n["release_id"] for n in nights if n.get("release_id")]
    assert len(published) == len(set(published)) == len(history["releases"]) - 1  # plus the creation release
    assert published == [n["release_id"] for n in nights[:3]] and nights[3].get("release_id") is None
    assert nights[0]["metrics"]["mean_reported_score"] == 0.0 and nights[0]["metrics"]["judged"] == 1

    # The pool grows and no skill ever disappears.
    seed = history["control_pools"][0]["skills"]
    pools = [seed] + [p["skills"] for p in history["method_pools"]]
    for before, after in zip(pools, pools[1:]):
        assert set(before) <= set(after)
    assert len(pools[-1]) > len(seed)

    # The frozen control never changes.
    assert {p["release_id"] for p in history["control_pools"]} == {history["control_pools"][0]["release_id"]}
    assert all(p["skills"] == seed for p in history["control_pools"])

    # Day 4 beats the control's mean by more than two control SDs where errors name the facts; not elsewhere.
    final = history["method"][-1]
    for category in CATEGORIES:
        mean, sd = control_band(history, category)
        if category in LEARNABLE:
            assert final[category] > mean + 2 * sd, (category, final[category], mean, sd)
        else:
            assert final[category] <= mean + 2 * sd, (category, final[category], mean, sd)
    # The pass rate rises day by day on the learnable categories (two facts learnt per night and skill).
    for category in LEARNABLE:
        rates = [day[category] for day in history["method"]]
        assert rates == sorted(rates) and rates[0] == 0.0 and rates[-1] == 1.0
