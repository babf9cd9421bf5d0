"""The roles beside `reef serve`: a replica (``server.learner=false``) applies its recipe's door rule on reports and trains
nothing; `reef learn` refuses a config it cannot run, naming the key."""

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


def test_reef_learn_refuses_bad_config_naming_the_key(tmp_path):
    import subprocess

    from reef_core.testing.fixtures import REEF

    base = [*REEF, "learn", f"storage.data_dir={tmp_path}", "engine.kind=upstream",
            "engine.upstream_url=http://127.0.0.1:9"]
    no_recipe = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert no_recipe.returncode == 2 and "needs a recipe" in no_recipe.stderr
    interval = subprocess.run([*base, "recipe.name=steps", "recipe.processor=per_report",
                               "server.follow_interval_s=0"], capture_output=True, text=True, timeout=60)
    assert interval.returncode == 2 and "server.follow_interval_s" in interval.stderr


def test_on_sqlite_a_replica_and_reef_learn_share_one_data_dir(reef_server, fake_upstream_url, tmp_path):
    """One machine without PostgreSQL: the learner process keeps the file commit log; the replica polls the head."""
    import subprocess

    from reef_core.commit.commitlog import CommitLog
    from reef_core.testing.fixtures import REEF, wait_until

    data_dir = tmp_path / "shared"
    config = ["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", "recipe.name=steps",
              "recipe.processor=per_report", "+recipe.processor_options.batch_size=1",
              "recipe.trainer=reef_core.testing.step_trainer:StepTrainer", "recipe.surface=harness",
              "server.follow_interval_s=0.5"]
    server = reef_server(*config, "server.learner=false", data_dir=data_dir)
    sc = "solo"
    receipt = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": sc},
                         json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).headers[
        "x-reef-agent-record-id"]
    with open(tmp_path / "learn.log", "wb") as out:
        learner = subprocess.Popen([*REEF, "learn", f"storage.data_dir={data_dir}", *config], stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        log = CommitLog.for_scenario(data_dir / "commits", sc, writer=False)
        wait_until(lambda: log.last_step() >= 1, timeout=60, what="release 0")
        response = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": sc},
                              json={"score": 1.0, "references": [receipt]})
        assert response.status_code == 200, response.text
        wait_until(lambda: log.last_step() >= 2, timeout=30, what="a trained step")
        release_id = log.row(2)["release_id"]

        def serving():
            return httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": sc},
                              json={"model": "m", "messages": [{"role": "user", "content": "?"}]}).headers.get(
                "x-reef-release-id")

        wait_until(lambda: serving() == release_id, timeout=5, what="the replica serving the new release")
        assert response.json()["agent_record_id"] in log.row(2)["consumed_ids"]
    finally:
        learner.terminate()
        assert learner.wait(timeout=30) == 0
