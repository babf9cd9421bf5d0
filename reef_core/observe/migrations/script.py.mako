"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from alembic import context, op
import sqlalchemy as sa
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def _schema() -> str | None:
    """The store's schema (PostgreSQL) or None (SQLite), set by reef_core.observe.engine.migrate; give it to
    every op."""
    return context.config.attributes.get("schema")


def upgrade() -> None:
    schema = _schema()
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    schema = _schema()
    ${downgrades if downgrades else "pass"}
