"""Initial record-store tables: scenarios, records, sequences, idempotency keys, consumed ids.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _schema() -> str | None:
    """The store's schema (PostgreSQL) or None (SQLite), set by reef_core.observe.engine.migrate; give it to
    every op."""
    return context.config.attributes.get("schema")


def upgrade() -> None:
    schema = _schema()
    op.create_table(
        "scenarios",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("recipe", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("archived", sa.Boolean(), nullable=False),
        schema=schema,
    )
    op.create_table(
        "records",
        sa.Column("record_id", sa.String(255), primary_key=True),
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
        sa.UniqueConstraint("scenario", "sequence", name="uq_records_scenario_sequence"),
        schema=schema,
    )
    op.create_index(
        "ix_records_request_hash", "records", ["scenario", "request_hash", "created_at"], schema=schema
    )
    op.create_table(
        "record_sequences",
        sa.Column("scenario", sa.String(255), primary_key=True),
        sa.Column("last_sequence", sa.BigInteger(), nullable=False),
        schema=schema,
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("scenario", sa.String(255), primary_key=True),
        sa.Column("idempotency_key", sa.String(255), primary_key=True),
        sa.Column("record_id", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        schema=schema,
    )
    op.create_table(
        "consumed_ids",
        sa.Column("scenario", sa.String(255), primary_key=True),
        sa.Column("record_id", sa.String(255), primary_key=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("consumed_at", sa.Double(), nullable=False),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    op.drop_table("consumed_ids", schema=schema)
    op.drop_table("idempotency_keys", schema=schema)
    op.drop_table("record_sequences", schema=schema)
    op.drop_index("ix_records_request_hash", table_name="records", schema=schema)
    op.drop_table("records", schema=schema)
    op.drop_table("scenarios", schema=schema)
