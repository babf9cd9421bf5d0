"""records: the primary key becomes (record_id, scenario): record ids are scoped per scenario (#37 D5).

Existing ids are unique across the store, so they stay unique per scenario: no row changes. SQLite cannot alter a
primary key in place: the table is rebuilt (batch mode), indexes and constraints included.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

import warnings

from alembic import context, op
from sqlalchemy.exc import SAWarning

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return context.config.attributes.get("schema")


def _primary_key(columns: list[str]) -> None:
    schema = _schema()
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint("records_pkey", "records", type_="primary", schema=schema)
        op.create_primary_key("records_pkey", "records", columns, schema=schema)
        return
    with warnings.catch_warnings():
        # The copy starts from the reflected key and takes the new one; SQLAlchemy says so, as it should.
        warnings.filterwarnings("ignore", message=".*specifies columns .* as primary_key=True", category=SAWarning)
        with op.batch_alter_table("records", schema=schema, recreate="always") as batch:
            batch.create_primary_key("records_pkey", columns)


def upgrade() -> None:
    _primary_key(["record_id", "scenario"])


def downgrade() -> None:  # only while no id is used in two scenarios
    _primary_key(["record_id"])
