"""usage_counters: token usage per token or scenario and period (rate limits and budgets).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return context.config.attributes.get("schema")


def upgrade() -> None:
    op.create_table(
        "usage_counters",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("period", sa.String(16), primary_key=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("usage_counters", schema=_schema())
