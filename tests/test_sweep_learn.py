"""``reef sweep -m ... task=learn`` on the SAO recipe: its loop run offline on its vowel task file. Four jobs as a real
process write one metrics file each and a summary table (the tiny model; 16 rollouts a job keep the sweep near half
a minute); one job run twice in process repeats itself and keeps every record."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

LRS = ("0.001", "0.01")


def test_sweep_learn_writes_comparable_metrics_and_a_summary_table(tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "reef_core.cli", "sweep", "-m", "+recipe=sao", "+sao_profile=tiny", "engine.model=tiny",
         f"trainer.lr={','.join(LRS)}", "seed=0,1", "task=learn", "learn.rollouts=16", "learn.window=8",
         f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "REEF_MODEL_CACHE": str(tmp_path / "models")})  # one tiny model for the four jobs
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    files = sorted(sweep.glob("*/metrics.json"))
    assert len(files) == 4
    runs = {}
    for path in files:
        metrics = json.loads(path.read_text())
        assert metrics["task"] == "learn" and metrics["recipe"] == "sao"
        assert len(metrics["rewards"]) == 16 and all(0.0 <= r <= 1.0 for r in metrics["rewards"])
        assert len(metrics["reward_curve"]) == 2
        assert metrics["first_window_mean"] == metrics["reward_curve"][0]
        assert metrics["last_window_mean"] == metrics["reward_curve"][-1]
        # batch_size 4 (tiny profile), policy "always": every batch of 4 reports became a served version
        assert metrics["steps"] == 4 and metrics["versions_published"] == 4 and metrics["errors"] == 0
        assert metrics["wall_s"] > 0
        assert f"seed={metrics['seed']}" in metrics["overrides"]
        # the job's data (records, releases) stays in its own directory
        assert (path.parent / "data" / "records.db").exists()
        runs[(repr(metrics["lr"]), metrics["seed"])] = metrics["rewards"]
    assert set(runs) == {(repr(float(lr)), seed) for lr in LRS for seed in (0, 1)}
    for lr in LRS:  # the seed changes the run (sampler, task order, trainer init)
        assert runs[(repr(float(lr)), 0)] != runs[(repr(float(lr)), 1)]
    for seed in (0, 1):  # so does the learning rate, once the first step has published
        low, high = runs[(repr(float(LRS[0])), seed)], runs[(repr(float(LRS[1])), seed)]
        assert low[:4] == high[:4]  # the first batch is served by the same base weights and sampler
        assert low[4:] != high[4:]
    table = result.stdout[result.stdout.index("job  overrides"):].splitlines()
    assert len(table) == 5
    for row, lr, seed in zip(table[1:], (LRS[0], LRS[0], LRS[1], LRS[1]), (0, 1, 0, 1)):
        assert f"trainer.lr={lr} seed={seed}" in row


def test_a_learn_job_repeats_for_its_seed_and_keeps_every_record(tmp_path, monkeypatch):
    """In process: the same job twice gives the same rewards (on-policy, seeded sampler, trainer and task order);
    the job's store holds one inference and one report per rollout, and its chain the published versions."""
    from reef_core.builtins.tasks import learn
    from reef_core.config import compose_config
    from reef_core.observe.records import RecordStore

    monkeypatch.setenv("REEF_MODEL_CACHE", str(tmp_path / "models"))
    cfg = compose_config(["+recipe=sao", "+sao_profile=tiny", "task=learn", "learn.rollouts=8", "learn.window=4",
                          "seed=3"])
    first = learn(cfg, tmp_path / "a")
    second = learn(cfg, tmp_path / "b")
    rewards = [json.loads((tmp_path / job / "metrics.json").read_text())["rewards"] for job in "ab"]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 8
    assert first["reward_curve"] == second["reward_curve"] and first["versions_published"] == 2
    store = RecordStore.open(None, tmp_path / "a" / "data")
    try:
        records = list(store.replay("learn", 0))
    finally:
        store.close()
    assert [r.kind for r in records].count("inference") == 8 and [r.kind for r in records].count("report") == 8
    inferences = {r.record_id: r for r in records if r.kind == "inference"}
    for report in (r for r in records if r.kind == "report"):
        assert report.references[0] in inferences  # each report quotes its rollout's record
    assert all("tokens" in r.payload and r.version for r in inferences.values())  # trainable, versioned
    # each rollout's request carries the task's reply budget (learn.max_tokens: 8 on the tiny profile), issue #37
    assert {r.payload["request"].get("max_tokens") for r in inferences.values()} == {8}
    # on-policy: the first batch of 4 was served by the start weights, the second by the first published version
    served = [r.version for r in records if r.kind == "inference"]
    assert len(set(served[:4])) == 1 and len(set(served[4:])) == 1 and served[0] != served[4]
