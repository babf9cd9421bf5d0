"""The lookups each write batch makes find their rows through an index, whatever the table's statistics say: on
PostgreSQL a store's records table is new, or growing faster than autovacuum analyses it, for its first minutes,
and "record_id IN (...)" was then planned as a scan of the whole table per batch; the idempotency-key lookup named
only the second column of its primary key and scanned the table on both backends."""

from __future__ import annotations

import os
import uuid

import pytest

from reef_core.observe import queries as q
from reef_core.observe.batch import _driver_sql
from reef_core.observe.model import Record
from reef_core.observe.records import RecordStore


def _fill(store: RecordStore, count: int) -> list[Record]:
    stored = []
    for first in range(0, count, 500):
        stored += store.append_many_sync([
            Record(record_id=uuid.uuid4().hex, scenario="s", kind="inference", payload={"text": os.urandom(700).hex()})
            for _ in range(min(500, count - first))])
    return stored


@pytest.mark.postgres
def test_the_batch_lookup_searches_the_primary_key_of_an_unanalysed_postgres_table(tmp_path, records_database):
    url, options = records_database
    if url is None:
        pytest.skip("the PostgreSQL plan")
    store = RecordStore.open(url, tmp_path, **options)
    try:
        stored = _fill(store, 3000)
        keys = [(r.scenario, r.record_id) for r in stored[:32]] + [("s", uuid.uuid4().hex) for _ in range(32)]
        with store.sql_engine.connect() as conn:
            sql = _driver_sql(conn).select_by_keys
            params = ([rid for _, rid in keys], [s for s, _ in keys])
            plan = "\n".join(row[0] for row in conn.exec_driver_sql("EXPLAIN " + sql, params))
            found = {(row.scenario, row.record_id) for row in conn.exec_driver_sql(sql, params)}
        assert "records_pkey" in plan and "Seq Scan on records" not in plan, plan
        assert found == set(keys[:32])  # the stored ones, and only those
    finally:
        store.close()


def test_the_idempotency_key_lookup_searches_its_primary_key(tmp_path):
    store = RecordStore.open(None, tmp_path)
    try:
        stmt = q.keys_by_key("sqlite").params(scenario="s", keys=["a", "b"])
        with store.sql_engine.connect() as conn:
            sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
            plan = " ".join(str(row[-1]) for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
        assert "SEARCH idempotency_keys" in plan and "SCAN" not in plan, plan
    finally:
        store.close()


def test_a_keyed_append_finds_its_key_only_in_its_own_scenario(tmp_path, records_database):
    """The key lookup now names the scenario: the same key in two scenarios stays two keys."""
    import asyncio

    url, options = records_database
    store = RecordStore.open(url, tmp_path, **options)

    async def append(scenario: str, record_id: str) -> Record:
        record = Record(record_id=record_id, scenario=scenario, kind="inference", payload={"n": 1})
        return await store.append(record, idempotency_key="same-key")

    try:
        a1 = asyncio.run(append("a", "r1"))
        b1 = asyncio.run(append("b", "r2"))
        a2 = asyncio.run(append("a", "r3"))  # a complete record under a's key: replayed
        assert (a1.record_id, b1.record_id, a2.record_id) == ("r1", "r2", "r1")
        assert store.find_by_idempotency_key("b", "same-key").record_id == "r2"
    finally:
        store.close()


