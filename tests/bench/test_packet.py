"""Result packets (issue #38): the statistics of bench/packet.py on known data, the four files, and
``python -m bench results`` end to end through ``reef serve`` (one short seed)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench import packet
from bench.packet import ArmRun, analyse, diagnose

ROOT = Path(__file__).resolve().parents[2]


def arm(name: str, seed: int, first: float, last: float, n: int = 96, steps: int = 5, dropped=None,
        noise: str | None = None) -> ArmRun:
    """Rewards drawn around ``first`` then moving linearly to ``last`` (noise 0.1, from ``noise`` or the arm and
    seed), with replies."""
    rng = random.Random(noise or f"{name}-{seed}")
    rewards = [min(1.0, max(0.0, first + (last - first) * i / (n - 1) + rng.gauss(0, 0.1))) for i in range(n)]
    replies = [{"prompt": f"task {i}", "reply": f"reply {i} | of {name}", "reward": r} for i, r in enumerate(rewards)]
    return ArmRun(name, seed, rewards, replies, 1.0, steps if name == "recipe" else 0, steps, dropped or {})


def test_a_clear_effect_holds_with_an_interval_around_it():
    runs = [r for s in range(3) for r in (arm("recipe", s, 0.2, 0.7), arm("control", s, 0.2, 0.2))]
    out = analyse(runs, 24)
    lo, hi = out["difference"]["ci95"]
    assert out["holds"] and 0 < lo < out["difference"]["mean"] < hi
    assert 0.3 < out["arms"]["recipe"]["gain"] < 0.55  # windows of 24 of a ramp 0.2 -> 0.7: about 0.37
    clo, chi = out["arms"]["control"]["ci95"]
    assert clo < 0 < chi
    assert diagnose(out, runs) == []


def test_no_effect_does_not_hold_and_says_why():
    # the same draws in both arms: no difference at all, and the interval straddles 0
    runs = [r for s in range(3) for r in (arm("recipe", s, 0.3, 0.3, noise=str(s)),
                                          arm("control", s, 0.3, 0.3, noise=str(s)))]
    out = analyse(runs, 24)
    assert out["difference"]["mean"] == 0
    lo, hi = out["difference"]["ci95"]
    assert not out["holds"] and lo < 0 < hi
    assert any("not above 0" in line for line in diagnose(out, runs))
    starved = [ArmRun(r.arm, r.seed, r.rewards, steps=0, dropped={"stale": 80} if r.arm == "recipe" else {})
               for r in runs]
    reasons = diagnose(analyse(starved, 24), starved)
    assert any("no training step" in line for line in reasons) and any("stale 240" in line for line in reasons)
    assert any("never reached the learner" in line for line in reasons)
    skipped = [ArmRun(r.arm, r.seed, r.rewards, steps=0, dropped={"trainer_skipped": 80} if r.arm == "recipe" else {})
               for r in runs]
    assert any("made no candidate from any batch" in line for line in diagnose(analyse(skipped, 24), skipped))


def test_arms_must_share_their_seeds_and_hold_two_windows():
    with pytest.raises(ValueError, match="same seeds"):
        analyse([arm("recipe", 0, 0.2, 0.5), arm("control", 1, 0.2, 0.2)], 24)
    with pytest.raises(ValueError, match="two windows"):
        analyse([ArmRun("recipe", 0, [0.5]), ArmRun("control", 0, [0.5])], 24)
    with pytest.raises(ValueError, match="unknown arm"):
        analyse([ArmRun("other", 0, [0.5, 0.5])], 1)


def test_the_packet_holds_its_four_files(tmp_path):
    runs = [r for s in range(2) for r in (arm("recipe", s, 0.2, 0.7), arm("control", s, 0.2, 0.2))]
    setting = {"recipe": "demo", "overrides": {"recipe": ["+recipe=demo"], "control": ["+recipe=demo", "x=1"]}}
    metrics = packet.write(tmp_path, title="demo", setting=setting, runs=runs, window=24)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "curve.png", "metrics.json", "samples.md"]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "metrics.json").read_text())["analysis"] == json.loads(json.dumps(
        metrics["analysis"]))
    readme = (tmp_path / "README.md").read_text()
    assert "**Holds**" in readme and "`+recipe=demo x=1`" in readme and "| recipe |" in readme
    samples = (tmp_path / "samples.md").read_text()
    before, after = samples.split("## After")
    rows = [[line for line in part.splitlines() if line.startswith(("| 0 |", "| 1 |"))] for part in (before, after)]
    assert [len(r) for r in rows] == [20, 20]
    assert "\\|" in samples  # a reply's pipe cannot break the table


@pytest.mark.slow
def test_bench_results_writes_a_packet_through_reef_serve(tmp_path):
    out = tmp_path / "packet"
    done = subprocess.run([sys.executable, "-m", "bench", "results", "--seeds", "1", "--rollouts", "96", "--window",
                           "48", "--concurrency", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert (out / "metrics.json").is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["arm"]: r for r in json.loads((out / "metrics.json").read_text())["runs"]}
    assert len(runs["recipe"]["rewards"]) == len(runs["control"]["rewards"]) == 96
    assert runs["recipe"]["steps"] >= 1 and runs["control"]["steps"] == 0  # learning off in the control arm
    assert "server.learner=false" in (out / "README.md").read_text()
