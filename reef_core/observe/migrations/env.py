"""Alembic environment for the record store.

Only online, programmatic use is supported: the caller puts an open connection (inside a transaction) in
``config.attributes["connection"]`` and the target schema (PostgreSQL, or ``None``) in ``config.attributes["schema"]``.
"""

from alembic import context

from reef_core.observe.schema import VERSION_TABLE, metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("record-store migrations run through reef_core.observe.engine.migrate(), not the alembic CLI")

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    version_table_schema=config.attributes.get("schema"),
)
with context.begin_transaction():
    context.run_migrations()
