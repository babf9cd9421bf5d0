"""records.top_k: packed top-K log-probs of an inference record's token data (NULL for records without).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return context.config.attributes.get("schema")


def upgrade() -> None:
    # A nullable column: existing rows read as "no top-K"; ADD COLUMN rewrites nothing on SQLite or PostgreSQL.
    op.add_column("records", sa.Column("top_k", sa.LargeBinary(), nullable=True), schema=_schema())


def downgrade() -> None:
    with op.batch_alter_table("records", schema=_schema()) as batch:  # SQLite cannot drop a column in place
        batch.drop_column("top_k")
