"""Record ids are scoped per scenario in the store (#37 D5): migration 0004 keys ``records`` by (record_id, scenario)
on SQLite and PostgreSQL, a store written before it keeps every record, and the same id then names one record per
scenario."""

from __future__ import annotations

import pytest
from reef_core.errors import Conflict
from reef_core.observe.engine import create_engines, current_revision, migrate, resolve_url
from reef_core.observe.records import Record, RecordStore


@pytest.fixture
def target(records_database, tmp_path):
    url, options = records_database
    return url, tmp_path, options


def _at_revision(url, data_dir, opts, revision: str) -> None:
    engines = create_engines(resolve_url(url, data_dir), schema=opts.get("schema"))
    try:
        migrate(engines, revision)
        assert current_revision(engines) == revision
    finally:
        engines.dispose()


def test_a_store_from_before_0004_keeps_its_records_and_then_scopes_ids(target):
    url, data_dir, opts = target
    _at_revision(url, data_dir, opts, "0003")
    old = Record(record_id="shared", scenario="before", kind="inference", payload={"v": 0})
    engines = create_engines(resolve_url(url, data_dir), schema=opts.get("schema"))
    table = f'"{engines.schema}".records' if engines.schema else "records"
    mark = "%s" if engines.dialect == "postgresql" else "?"
    try:
        with engines.raw[0].begin() as conn:  # a row as revision 0003's writer stored it
            conn.exec_driver_sql(
                f'INSERT INTO {table} (record_id, scenario, kind, sequence, created_at, version, complete, '
                f'request_hash, content_hash, "references", tags, payload) VALUES ({", ".join([mark] * 12)})',
                (old.record_id, old.scenario, "inference", 1, old.created_at, None, True, None, old.content_hash,
                 "[]", "{}", '{"v": 0}'))
    finally:
        engines.dispose()
    with RecordStore.open(url, data_dir, **opts) as store:  # migrates 0003 -> head
        assert current_revision(store._engines) >= "0004"  # migrated to the head (0004 or a later revision)
        kept = store.get("before", "shared")
        assert kept is not None and kept.payload == {"v": 0} and kept.content_hash == old.content_hash
        a = store.append_sync(Record(record_id="shared", scenario="team-a", kind="inference", payload={"v": 1}))
        b = store.append_sync(Record(record_id="shared", scenario="team-b", kind="inference", payload={"v": 2}))
        assert (a.sequence, b.sequence) == (1, 1)
        assert store.get("team-a", "shared").payload == {"v": 1} and store.get("team-b", "shared").payload == {"v": 2}
        with pytest.raises(Conflict):  # within a scenario an id still names one record
            store.append_sync(Record(record_id="shared", scenario="team-a", kind="inference", payload={"v": 3}))
        # a report's references resolve in its own scenario only
        store.append_sync(Record(record_id="rep", scenario="team-b", kind="report", payload={"score": 1.0},
                                 references=["shared"]), check_references=True)
