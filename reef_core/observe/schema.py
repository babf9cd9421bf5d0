"""Table definitions the record store queries (SQLAlchemy Core).

The tables are declared without a schema; a PostgreSQL store maps them into its own schema with
``schema_translate_map``, so one process can hold stores in several schemas. The Alembic migrations
(``reef_core/observe/migrations``) bring an older store to :data:`HEAD_REVISION`; a new store is created from these
definitions and stamped at it (Alembic's recipe for a new database). ``tests/observe`` checks that a migrated store
and a created one have the same DDL, and that :data:`HEAD_REVISION` is the migrations' head.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

#: Alembic's bookkeeping table for this store, kept apart from any other Alembic history in the same database.
VERSION_TABLE = "reef_records_alembic_version"
#: The newest migration's revision: the schema these tables describe. Raise it with every new migration.
HEAD_REVISION = "0005"

#: The version table as Alembic creates it (its primary key named as Alembic names it), for stamping a new store.
version_table = sa.Table(
    VERSION_TABLE,
    sa.MetaData(),
    sa.Column("version_num", sa.String(32), nullable=False),
    sa.PrimaryKeyConstraint("version_num", name=f"{VERSION_TABLE}_pkc"),
)

scenarios = sa.Table(
    "scenarios",
    metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("recipe", sa.String(255), nullable=False),
    sa.Column("created_at", sa.Double(), nullable=False),
    sa.Column("archived", sa.Boolean(), nullable=False),
)

records = sa.Table(
    "records",
    metadata,
    # Record ids are scenario-scoped: each scenario is its own namespace of ids (#37 D5), so no team can learn of,
    # claim or be locked out of another's.
    sa.Column("record_id", sa.String(255), nullable=False),
    sa.Column("scenario", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("sequence", sa.BigInteger(), nullable=False),
    sa.Column("created_at", sa.Double(), nullable=False),
    sa.Column("version", sa.String(255), nullable=True),
    sa.Column("complete", sa.Boolean(), nullable=False),
    sa.Column("request_hash", sa.String(128), nullable=True),
    sa.Column("content_hash", sa.String(128), nullable=False),
    sa.Column("references", sa.JSON(), nullable=False),
    sa.Column("tags", sa.JSON(), nullable=False),
    sa.Column("payload", sa.JSON(), nullable=False),
    # Packed top-K log-probs of the payload's token data (reef_core.topk); NULL when none were captured.
    sa.Column("top_k", sa.LargeBinary(), nullable=True),
    # Named as migration 0004 names it (PostgreSQL's default name), so a new SQLite store matches a migrated one.
    sa.PrimaryKeyConstraint("record_id", "scenario", name="records_pkey"),
    sa.UniqueConstraint("scenario", "sequence", name="uq_records_scenario_sequence"),
    sa.Index("ix_records_request_hash", "scenario", "request_hash", "created_at"),
)

# Per-scenario sequence counters: one upsert per scenario per batch hands out a contiguous range, and the row lock
# keeps two writers (two processes on one PostgreSQL schema) from handing out the same numbers.
record_sequences = sa.Table(
    "record_sequences",
    metadata,
    sa.Column("scenario", sa.String(255), primary_key=True),
    sa.Column("last_sequence", sa.BigInteger(), nullable=False),
)

idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("scenario", sa.String(255), primary_key=True),
    sa.Column("idempotency_key", sa.String(255), primary_key=True),
    sa.Column("record_id", sa.String(255), nullable=False),
    sa.Column("created_at", sa.Double(), nullable=False),
)

consumed_ids = sa.Table(
    "consumed_ids",
    metadata,
    sa.Column("scenario", sa.String(255), primary_key=True),
    sa.Column("record_id", sa.String(255), primary_key=True),
    sa.Column("step", sa.BigInteger(), nullable=False),
    sa.Column("consumed_at", sa.Double(), nullable=False),
)

# Token usage per key (``token:<name>`` or ``scenario:<name>``) and period (``2026-11-30``, ``2026-11`` or ``total``):
# the counters behind rate limits and budgets (reef_core.serve.middleware.usage), incremented by upserts so replicas add up.
usage_counters = sa.Table(
    "usage_counters",
    metadata,
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("period", sa.String(16), primary_key=True),
    sa.Column("tokens", sa.BigInteger(), nullable=False),
    sa.Column("requests", sa.BigInteger(), nullable=False),
    sa.Column("updated_at", sa.Double(), nullable=False),
)

# Record bodies retention compacted (reef_core.observe.compaction), per scenario and reason (consumed, expired,
# max_bytes): updated in the transaction that compacts them, so the counts survive restarts and add up across
# processes.
record_compactions = sa.Table(
    "record_compactions",
    metadata,
    sa.Column("scenario", sa.String(255), primary_key=True),
    sa.Column("reason", sa.String(16), primary_key=True),
    sa.Column("records", sa.BigInteger(), nullable=False),
    sa.Column("bytes_before", sa.BigInteger(), nullable=False),
    sa.Column("bytes_after", sa.BigInteger(), nullable=False),
    sa.Column("updated_at", sa.Double(), nullable=False),
)
