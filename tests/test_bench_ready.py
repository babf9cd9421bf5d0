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
    args = parser.parse_args(["--model", "tiny", "--rounds", "1", "--tokens", "4", "--timeout", "120",
                              "--cache", os.environ["REEF_MODEL_CACHE"]])
    result = ready.run(args)
    assert result["problems"] == []
    (only,) = result["rounds"]["reef"]
    assert only["ready_s"] > 0 and only["first_s"] > 0 and only["first_tokens"] == 1
    assert 1 <= only["first_4_tokens"] <= 4
    summary = result["summary"]["reef"]
    assert summary["ready_s"]["target"] == ready.READY_TARGET_S and summary["first_s"]["target"] == ready.FIRST_TARGET_S
    assert result["machine"]["load_avg_1m_at_start"] >= 0
