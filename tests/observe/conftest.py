"""Fixtures of the record-store tests."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def records_database(request):
    """``(url, options)`` of an empty record database for ``RecordStore.open(url, data_dir, **options)``: SQLite
    (url None: a file in the data dir) or a schema of the test's own in PostgreSQL, dropped afterwards so parallel
    or old runs never see each other's rows."""
    if request.param == "sqlite":
        yield None, {}
        return
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {exc.orig}")
    schema = f"reef_test_{uuid.uuid4().hex[:12]}"
    yield PG_URL, {"schema": schema}
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    engine.dispose()
