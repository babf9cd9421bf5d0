"""``python -m bench retention`` on a few hundred records: it measures a smaller store after compaction and loses
nothing (the 100k-record run is the benchmark, not a test)."""

from __future__ import annotations

import pytest

from bench import retention
from bench.__main__ import main


@pytest.mark.slow
def test_the_retention_bench_shrinks_the_store_and_loses_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("bench.common.RESULTS", tmp_path)
    assert main(["retention", "--records", "300", "--backends", "sqlite"]) == 0
    out = capsys.readouterr().out
    assert "after/before" in out and "PROBLEM" not in out
    assert retention.BATCH == 500
