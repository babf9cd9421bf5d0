"""Fixtures of the record-store tests."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture
def pg_schemas():
    """A factory of schema names of the test's own in PostgreSQL (skips the test when PostgreSQL is not
    reachable); every schema it named is dropped afterwards, so parallel or old runs never see each other's rows."""
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {exc.orig}")
    named: list[str] = []

    def new_schema() -> str:
        named.append(f"reef_test_{uuid.uuid4().hex[:12]}")
        return named[-1]

    yield new_schema
    with engine.begin() as conn:
        for schema in named:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def records_database(request):
    """``(url, options)`` of an empty record database for ``RecordStore.open(url, data_dir, **options)``: SQLite
    (url None: a file in the data dir) or a schema of the test's own in PostgreSQL (:func:`pg_schemas`)."""
    if request.param == "sqlite":
        return None, {}
    return PG_URL, {"schema": request.getfixturevalue("pg_schemas")()}
