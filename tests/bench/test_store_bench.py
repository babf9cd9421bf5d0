"""``python -m bench store`` on a few hundred records: every record is stored, and each run is printed beside the raw
batched-insert contender writing the same rows into the same table (the 20k-record run is the benchmark)."""

from __future__ import annotations

import sqlite3

import pytest

from bench import store_raw
from bench.__main__ import main
from bench.store import _payload


@pytest.mark.slow
def test_the_store_bench_stores_every_record_and_prints_reef_over_raw(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("bench.common.RESULTS", tmp_path)
    assert main(["store", "--backends", "sqlite", "--records", "400", "--single", "5", "--concurrency", "8,64"]) == 0
    out = capsys.readouterr().out
    assert "PROBLEM" not in out and "Reef/raw" in out and "fsync of a 4 KiB write" in out
    # one raw row per Reef run: the single appender against single-row transactions, 8 and 64 against as many rows
    raw_table = out.split("raw batched inserts")[1]
    assert [line.split()[1] for line in raw_table.splitlines() if line.startswith("sqlite")] == ["1", "8", "64"]


def test_the_raw_contender_writes_the_rows_durably_into_the_stores_table(tmp_path):
    from reef_core.observe.records import RecordStore

    RecordStore.open(None, tmp_path).close()  # the store's migrations build the table the contender writes
    result = store_raw.sqlite_runs(str(tmp_path / "records.db"), _payload, [(130, 64)])[0]
    assert result["records"] == 130 and result["commit_ms"]["n"] == 3  # 64 + 64 + 2 rows, a commit each
    with sqlite3.connect(tmp_path / "records.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        sequences = [row[0] for row in conn.execute('SELECT "sequence" FROM records ORDER BY "sequence"')]
    assert sequences == list(range(1, 131))
    store = RecordStore.open(None, tmp_path)
    try:  # the rows read back as records of the store
        with store.sql_engine.connect() as conn:
            scenario = conn.exec_driver_sql("SELECT scenario FROM records").scalar()
        assert store.page(scenario, 0, 2)[0].payload == _payload(0)
    finally:
        store.close()
