"""Revision scripts of the record store (Alembic skips this file)."""
