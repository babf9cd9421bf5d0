"""Alembic migrations of the record store, run programmatically by :func:`reef_core.observe.engine.migrate`."""
