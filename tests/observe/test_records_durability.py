"""Durability and schema management of the record store: reopen, SIGKILL mid-stream, Alembic migrations."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.config import Config

from reef_core.errors import ConfigError
from reef_core.observe.engine import MIGRATIONS_DIR, create_engines, current_revision, migrate, resolve_url
from reef_core.observe.records import Record, RecordStore
from reef_core.observe.schema import VERSION_TABLE, metadata

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def target(records_database, tmp_path):
    """``(url, data_dir, opts)`` of an empty store location."""
    url, opts = records_database
    return url, tmp_path, opts


def test_records_survive_close_and_reopen(target):
    url, data_dir, opts = target
    records = [Record(record_id=f"r{i}", scenario="s", kind="inference", payload={"i": i, "text": "é" * i},
                      tags={"n": str(i)}, version="v1") for i in range(30)]

    async def write(store):
        return await asyncio.gather(*[store.append(r) for r in records])

    with RecordStore.open(url, data_dir, **opts) as store:
        written = asyncio.run(write(store))
        store.get_or_create_scenario("s", "sao")
        store.mark_consumed("s", ["r1"], step=4)
    with RecordStore.open(url, data_dir, **opts) as store:
        assert list(store.replay("s")) == sorted(written, key=lambda r: r.sequence)
        assert store.get_scenario("s").recipe == "sao"
        assert store.consumed_ids("s") == {"r1"}
        assert store.append_sync(Record(record_id="next", scenario="s", kind="inference", payload={})).sequence == 31


CHILD = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from reef_core.observe.records import Record, RecordStore

    url, data_dir, schema = sys.argv[1] or None, Path(sys.argv[2]), sys.argv[3] or None
    store = RecordStore.open(url, data_dir, **({"schema": schema} if schema else {}))

    async def worker(w):
        i = 0
        while True:
            record = Record(record_id=f"w{w}-{i}", scenario="kill", kind="inference",
                            payload={"messages": [{"role": "user", "content": "x" * 500}], "i": i})
            stored = await store.append(record)
            sys.stdout.write(stored.record_id + "\\n")
            sys.stdout.flush()
            i += 1

    async def main():
        await asyncio.gather(*[worker(w) for w in range(16)])

    asyncio.run(main())
""")


def test_every_acknowledged_record_survives_sigkill(target, tmp_path):
    url, data_dir, opts = target
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, str(script), url or "", str(data_dir), opts.get("schema", "")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    acknowledged: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while len(acknowledged) < 400:
            line = child.stdout.readline()
            if not line:
                raise AssertionError(f"child exited early: {child.stderr.read().decode()[-2000:]}")
            acknowledged.append(line.decode().strip())
            assert time.monotonic() < deadline, "child too slow"
        os.kill(child.pid, signal.SIGKILL)  # mid-stream: appends are in flight
        rest, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    # Only complete lines were acknowledged; a torn last line was not.
    acknowledged += [line for line in rest.decode().split("\n")[:-1] if line]

    with RecordStore.open(url, data_dir, **opts) as store:
        missing = [record_id for record_id in acknowledged if store.get("kill", record_id) is None]
        assert missing == []
        stored = list(store.replay("kill"))
        assert len(stored) >= len(acknowledged)
        assert [r.sequence for r in stored] == list(range(1, len(stored) + 1))  # no holes, no duplicates


def test_migrations_reach_head_and_match_the_table_definitions(target):
    url, data_dir, opts = target
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    head = ScriptDirectory.from_config(config).get_current_head()
    # Built by the migrations from nothing (RecordStore.open would create a new store from the definitions).
    engines = create_engines(resolve_url(url, data_dir), schema=opts.get("schema"))
    try:
        migrate(engines)
    finally:
        engines.dispose()
    with RecordStore.open(url, data_dir, **opts) as store:
        engines = store._engines
        assert current_revision(engines) == head
        with engines.raw[0].connect() as conn:
            schema = engines.schema
            tables = set(sa.inspect(conn).get_table_names(schema=schema))
            assert {"records", "scenarios", "record_sequences", "idempotency_keys", "consumed_ids",
                    VERSION_TABLE} <= tables
            if schema is None:
                ctx = MigrationContext.configure(conn, opts={"include_name": _only_store_tables})
                assert compare_metadata(ctx, metadata) == []
            else:
                assert _compare_in_schema(conn, schema) == []
                assert VERSION_TABLE not in sa.inspect(conn).get_table_names(schema="public")
    with RecordStore.open(url, data_dir, **opts) as store:  # opening again migrates nothing
        assert current_revision(store._engines) == head


def _only_store_tables(name, type_, parent_names):
    return type_ != "table" or name in metadata.tables


def _compare_in_schema(conn: sa.Connection, schema: str) -> list:
    """compare_metadata against a copy of the metadata placed in ``schema``."""
    placed = sa.MetaData(schema=schema)
    for table in metadata.tables.values():
        table.to_metadata(placed, schema=schema)
    ctx = MigrationContext.configure(conn, opts={
        "version_table": VERSION_TABLE, "version_table_schema": schema, "include_schemas": True,
        "include_name": lambda name, type_, parents: (name == schema if type_ == "schema"
                                                      else _only_store_tables(name, type_, parents))})
    return compare_metadata(ctx, placed)


def test_sqlite_store_is_wal_with_full_sync(tmp_path):
    with RecordStore.open(None, tmp_path) as store:
        with store._engines.writer.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    assert (tmp_path / "records.db").exists()


def test_bad_locations_are_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        RecordStore.open("mysql://localhost/x", tmp_path)
    with pytest.raises(ConfigError):
        RecordStore.open("sqlite:///:memory:", tmp_path)
    with pytest.raises(ConfigError):
        RecordStore.open(None, tmp_path, schema="x")
    with pytest.raises(ConfigError):
        RecordStore.open(PG_URL, tmp_path, schema="Bad-Name")


HOLD_LOCK = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()  # until killed
""")


def test_sqlite_writers_of_every_process_queue_on_one_file_lock(tmp_path):
    """Each write transaction on a SQLite store holds ``records.db.writelock``: while another process holds it, an
    append waits (without SQLite's sleep-and-retry), and a holder that is killed releases it."""
    import threading

    with RecordStore.open(None, tmp_path) as store:
        store.append_sync(Record(record_id="before", scenario="s", kind="inference", payload={}))
        lock_path = tmp_path / "records.db.writelock"
        assert lock_path.exists()
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock_path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            stored = []
            appender = threading.Thread(target=lambda: stored.append(store.append_sync(
                Record(record_id="during", scenario="s", kind="inference", payload={}))))
            appender.start()
            appender.join(timeout=1.0)
            assert appender.is_alive() and not stored  # queued behind the other process's lock
            assert [r.record_id for r in store.replay("s")] == ["before"]
        finally:
            holder.kill()
            holder.wait()
        appender.join(timeout=30)
        assert not appender.is_alive() and stored[0].record_id == "during"
        assert [r.record_id for r in store.replay("s")] == ["before", "during"]
