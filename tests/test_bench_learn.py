"""`python -m bench learn-smollm2`'s curve arithmetic: windows, the first-vs-last gain, the thinned table."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.learn_smollm2 import add_arguments, gain, run, thin, windows


def test_windows_split_in_report_order_with_a_short_tail():
    rewards = [0.0, 0.0, 1.0, 1.0, 0.5]
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert windows(rewards, times, 2) == [
        {"first": 1, "count": 2, "mean": 0.0, "end_s": 2.0},
        {"first": 3, "count": 2, "mean": 1.0, "end_s": 4.0},
        {"first": 5, "count": 1, "mean": 0.5, "end_s": 5.0}]


def test_gain_compares_the_first_and_last_full_windows():
    summary = gain([0.0, 0.2, 0.5, 0.5, 0.3, 0.5], 2)
    assert (summary["first"], summary["last"], summary["gain"]) == (0.1, 0.4, 0.3)
    assert summary["met"] and not summary["overlap"]
    few = gain([0.2, 0.25, 0.3], 2)  # 3 rollouts: the two windows share one
    assert few["overlap"] and not few["met"]
    assert gain([], 16) == {}


def test_thin_keeps_first_and_last_within_the_limit():
    rows = list(range(100))
    kept = thin(rows, 10)
    assert len(kept) == 10 and kept[0] == 0 and kept[-1] == 99 and kept == sorted(kept)
    assert thin(rows[:5], 10) == rows[:5]


@pytest.mark.slow
def test_tiny_profile_end_to_end(tmp_path, capsys):
    """The real `reef serve +recipe=sao +sao_profile=tiny` and example client for 3 s (~15 s in all)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cache = os.environ.get("REEF_MODEL_CACHE") or str(tmp_path / "models")
    result = run(parser.parse_args(["--model", "tiny", "--minutes", "0.05", "--concurrency", "2", "--cache", cache]))
    assert result["problems"] == [] and result["rollouts"] > 0
    assert sum(row["count"] for row in result["curve"]) == result["rollouts"] == len(result["rewards"])
    assert "load_avg_1m_at_end" in result["machine"]
    printed = capsys.readouterr().out
    assert "mean reward" in printed and "load avg 1m:" in printed
