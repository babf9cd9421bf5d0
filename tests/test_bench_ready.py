"""``python -m bench ready`` end to end on the tiny model: the real ``reef serve +recipe=sao`` started, ready, and
answering the openai SDK's first requests with receipts. ``python -m bench ready`` (SmolLM2) is the measurement."""

from __future__ import annotations

import argparse
import os

import pytest

pytest.importorskip("openai")

from bench import ready  # noqa: E402


@pytest.mark.slow  # ~10 s idle, ~20 s on the busy 2-core box (two process starts of torch)
def test_bench_ready_starts_the_server_and_times_its_first_requests():
    parser = argparse.ArgumentParser()
    ready.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--rounds", "1", "--tokens", "4", "--timeout", "120", "--idle", "1",
                              "--cache", os.environ["REEF_MODEL_CACHE"]])
    result = ready.run(args)
    assert result["problems"] == []
    (only,) = result["rounds"]["reef"]
    assert only["ready_s"] > 0 and only["first_s"] > 0 and only["first_tokens"] == 1
    assert 1 <= only["first_4_tokens"] <= 4
    assert 0 <= only["idle_cpu_pct"] < 100 * os.cpu_count()  # % of one core, every process of the server
    assert result["summary"]["reef"]["idle_cpu_pct"]["target"] == ready.IDLE_TARGET_PCT
    summary = result["summary"]["reef"]
    assert summary["ready_s"]["target"] == ready.READY_TARGET_S and summary["first_s"]["target"] == ready.FIRST_TARGET_S
    assert result["machine"]["load_avg_1m_at_start"] >= 0


def test_idle_cpu_counts_every_process_of_the_server(monkeypatch):
    """A server whose child spins reads up to one core (less on a busy machine); one that sleeps reads about nothing."""
    import subprocess
    import sys
    import types

    monkeypatch.setattr(ready, "IDLE_SETTLE_S", 0.2)
    spin = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(60)"
    for code, low, high in ((spin, 20, 130), ("import time; time.sleep(60)", 0, 5)):
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        try:
            pct = ready.idle_cpu_pct(types.SimpleNamespace(pid=proc.pid), 1.0)
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()
        assert low <= pct <= high, (code, pct)
