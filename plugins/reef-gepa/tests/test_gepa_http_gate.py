"""End to end over HTTP: GEPA candidates go through the gate; a rejected one changes nothing served."""

from __future__ import annotations

import contextlib

from reef_core.api import ReefClient

from reef_gepa.examples import reflector, task_model, tasks
from reef_gepa.examples.demo import PROMPT_FILE, pull, run_round, serve_reef, wait_for_step
from reef_gepa.examples.standins import serve_chat_model


def _run(tmp_path, *overrides, rounds=3):
    scenario = "gated-gepa"
    train = tasks("train")
    with contextlib.ExitStack() as stack:
        task_url = stack.enter_context(serve_chat_model(task_model))
        reflection_url = stack.enter_context(serve_chat_model(reflector))
        url = stack.enter_context(serve_reef(task_url, reflection_url, tmp_path, *overrides))
        client = stack.enter_context(ReefClient(url, scenario=scenario, timeout=120))
        first = None
        rows = []
        for index in range(rounds):
            harness = pull(client)
            prompt = harness["files"].get(PROMPT_FILE) if harness else None
            _scores, step, served_by = run_round(client, scenario, train[index * 3:(index + 1) * 3], prompt)
            first = first or harness or pull(client)
            harness, row = wait_for_step(client, scenario, step + 1)
            rows.append((row, harness, served_by))
        releases = client.releases()
        commits = client.commits()
    return first, rows, releases, commits


def test_selected_candidates_become_harness_releases(tmp_path):
    first, rows, releases, commits = _run(tmp_path)
    published = [row for row, _, _ in rows if row.get("release_id")]
    assert published, commits
    row, harness, _ = next((r, h, s) for r, h, s in rows if r.get("release_id"))
    assert harness["release_id"] == row["release_id"]  # GET /reef/harness serves the new release
    assert harness["files"][PROMPT_FILE] != first["files"][PROMPT_FILE]
    assert row["decision"]["decision"] == "select" and row["evaluation"]["scores"]
    assert len(releases) >= 2  # the creation release plus at least one evolved prompt


def test_rejected_candidates_leave_the_served_tree_unchanged(tmp_path):
    # A floor no candidate can reach: every proposal is evaluated, then rejected.
    first, rows, releases, commits = _run(tmp_path, "evaluation.policy=floor",
                                          "+evaluation.options.policy.floor_score=2.0")
    assert first is not None
    for row, harness, served_by in rows:
        assert row.get("release_id") is None
        assert harness["release_id"] == first["release_id"]
        assert harness["files"] == first["files"]
        assert served_by == {first["release_id"]}  # every inference ran on the unchanged harness
    rejected = [c for c in commits if c.get("decision") and c["decision"]["decision"] == "reject"]
    assert rejected and "floor" in rejected[0]["decision"]["reason"]
    assert len(releases) == 1  # only the creation release
