"""A new record store is created from the table definitions and stamped at the head; an older one is migrated.

Both ways must give the same database: the DDL of a store built by the Alembic migrations from nothing is compared
with that of a store created by ``RecordStore.open``, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap

import pytest
import sqlalchemy as sa
from alembic.config import Config
from alembic.script import ScriptDirectory

from reef_core.observe.engine import (MIGRATIONS_DIR, create_engines, current_revision, ensure_schema, migrate,
                                      resolve_url)
from reef_core.observe.records import Record, RecordStore
from reef_core.observe.schema import HEAD_REVISION, VERSION_TABLE

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def test_head_revision_is_the_migrations_head():
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    assert ScriptDirectory.from_config(config).get_current_head() == HEAD_REVISION


def _sqlite_ddl(engines) -> list[tuple]:
    with engines.reader.connect() as conn:
        rows = conn.exec_driver_sql("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").all()
    # Alembic's batch rebuilds quote names, create_all does not: compare the statements without quotes or spacing.
    return [(kind, name, table, re.sub(r'[\s"]+', " ", sql or "").strip()) for kind, name, table, sql in rows]


def _postgres_ddl(conn: sa.Connection, schema: str) -> dict:
    columns = conn.execute(sa.text(
        "SELECT table_name, column_name, ordinal_position, data_type, character_maximum_length, is_nullable, "
        "column_default FROM information_schema.columns WHERE table_schema = :s ORDER BY table_name, column_name"),
        {"s": schema}).all()
    constraints = conn.execute(sa.text(
        "SELECT rel.relname, con.conname, con.contype, pg_get_constraintdef(con.oid) FROM pg_constraint con "
        "JOIN pg_class rel ON rel.oid = con.conrelid JOIN pg_namespace ns ON ns.oid = rel.relnamespace "
        "WHERE ns.nspname = :s ORDER BY rel.relname, con.conname"), {"s": schema}).all()
    indexes = conn.execute(sa.text(
        "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = :s ORDER BY indexname"),
        {"s": schema}).all()
    return {"columns": [tuple(r) for r in columns], "constraints": [tuple(r) for r in constraints],
            "indexes": [(t, n, d.replace(f"{schema}.", "SCHEMA.")) for t, n, d in indexes]}


def test_a_created_sqlite_store_has_the_ddl_of_a_migrated_one(tmp_path):
    migrated = create_engines(resolve_url(None, tmp_path / "migrated"), schema=None)
    created = create_engines(resolve_url(None, tmp_path / "created"), schema=None)
    try:
        migrate(migrated)
        ensure_schema(created)
        assert current_revision(created) == current_revision(migrated) == HEAD_REVISION
        assert _sqlite_ddl(created) == _sqlite_ddl(migrated)
        migrate(created)  # Alembic finds nothing to do on a created store
        assert _sqlite_ddl(created) == _sqlite_ddl(migrated)
    finally:
        migrated.dispose()
        created.dispose()


@pytest.mark.postgres
def test_a_created_postgres_store_has_the_ddl_of_a_migrated_one(pg_schemas):
    names = [pg_schemas(), pg_schemas()]
    migrated = create_engines(resolve_url(PG_URL, None), schema=names[0])
    created = create_engines(resolve_url(PG_URL, None), schema=names[1])
    try:
        migrate(migrated)
        ensure_schema(created)
        assert current_revision(created) == current_revision(migrated) == HEAD_REVISION
        with migrated.raw[0].connect() as conn:
            ddl = [_postgres_ddl(conn, name) for name in names]
        assert ddl[0]["columns"] and VERSION_TABLE in {row[0] for row in ddl[0]["columns"]}
        # Constraint and index names carry no schema; the rest must be equal.
        assert ddl[1] == ddl[0]
    finally:
        migrated.dispose()
        created.dispose()


def test_an_older_store_is_migrated_to_the_head_keeping_its_records(tmp_path):
    engines = create_engines(resolve_url(None, tmp_path), schema=None)
    try:
        migrate(engines, "0004")
    finally:
        engines.dispose()
    with RecordStore.open(None, tmp_path) as store:
        assert current_revision(store._engines) == HEAD_REVISION
        asyncio.run(store.append(Record(record_id="r1", scenario="s", kind="inference", payload={}, tags={})))
    with RecordStore.open(None, tmp_path) as store:
        assert store.get("s", "r1") is not None


def test_opening_a_new_or_current_store_loads_no_alembic(tmp_path):
    """A serving process whose store needs no migration holds no Alembic (nor its Mako and Pygments)."""
    code = textwrap.dedent(f"""
        import sys
        from reef_core.observe.records import RecordStore
        for _ in range(2):  # a new store, then the same store again
            with RecordStore.open(None, {str(tmp_path)!r}):
                pass
        loaded = sorted(m for m in ("alembic", "mako", "pygments") if m in sys.modules)
        assert not loaded, loaded
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
