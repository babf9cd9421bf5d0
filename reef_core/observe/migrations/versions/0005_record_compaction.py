"""record_compactions: records whose bodies retention compacted, counted per scenario and reason.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return context.config.attributes.get("schema")


def upgrade() -> None:
    op.create_table(
        "record_compactions",
        sa.Column("scenario", sa.String(255), primary_key=True),
        sa.Column("reason", sa.String(16), primary_key=True),
        sa.Column("records", sa.BigInteger(), nullable=False),
        sa.Column("bytes_before", sa.BigInteger(), nullable=False),
        sa.Column("bytes_after", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("record_compactions", schema=_schema())
