"""Fixtures of the scale-out tests."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture
def pg_schema_engine():
    """A schema-mapped engine on a fresh PostgreSQL schema of the test's own (dropped afterwards), as a record store
    hands it out (``RecordStore.sql_engine``)."""
    raw = sa.create_engine(PG_URL)
    try:
        with raw.connect():
            pass
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {exc.orig}")
    schema = f"reef_test_{uuid.uuid4().hex[:12]}"
    with raw.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    yield raw.execution_options(schema_translate_map={None: schema}), schema
    with raw.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    raw.dispose()
