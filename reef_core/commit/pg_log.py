"""The commit log in PostgreSQL, for deployments whose record store is PostgreSQL.

Same contract as the file log (:class:`~reef_core.commit.commitlog.CommitLog`): rows with steps 1, 2, ...;
``append(row, expected_step)`` is a compare-and-swap on the step; an identical retry of a stored row returns it.
Here the CAS is the table's primary key ``(scenario, step)``: a second writer inserting the same step loses with a
unique violation, inside the transaction that first checked ``expected_step`` is the last step. Any process that
reaches the database reads the log, so a learner that takes over a scenario (see :mod:`reef_core.loop.lease`)
resumes from the rows its predecessor committed, on any machine.

The table (``reef_commit_log``) lives in the record store's schema and is created on first use.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa

from reef_core.commit.commitlog import _same, normalize_row
from reef_core.commit.release import scenario_path
from reef_core.errors import Conflict, StorageUnavailable, ValidationFailed


def _pg_insert(table: sa.Table):
    # Imported when used: a SQLite deployment never loads the PostgreSQL dialect.
    from sqlalchemy.dialects.postgresql import insert

    return insert(table)


_METADATA = sa.MetaData()
COMMIT_LOG = sa.Table(
    "reef_commit_log", _METADATA,
    sa.Column("scenario", sa.Text, primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("row", sa.Text, nullable=False),
)
_created: set[int] = set()
_create_lock = threading.Lock()


def ensure_table(engine: sa.Engine) -> None:
    """Create the table in the store's schema once per engine (concurrent creators are serialised)."""
    with _create_lock:
        if id(engine) in _created:
            return
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('reef-commit-log-table'))"))
            _METADATA.create_all(conn, checkfirst=True)
        _created.add(id(engine))


class PgCommitLog:
    """The commit log of one scenario in PostgreSQL; ``writer=False`` refuses appends.

    ``engine`` is the record store's schema-mapped engine (:attr:`RecordStore.sql_engine`); ``fence`` as on the
    attribute. ``path`` names the
    scenario's per-process files kept beside the log (release metrics), as the file log's path does."""

    def __init__(self, engine: sa.Engine, scenario: str, commits_dir: str | Path, *, writer: bool = True,
                 fence=None):
        if engine.dialect.name != "postgresql":
            raise ValidationFailed("PgCommitLog needs a PostgreSQL engine")
        self.engine = engine
        self.scenario = scenario
        self.writer = writer
        #: ``fence(conn)``, run inside each append's transaction: raises to refuse the append (a learner that
        #: lost its lease, see ``reef_core.loop.lease``); None: no fence.
        self.fence = fence
        self.path = scenario_path(commits_dir, scenario, ".jsonl")
        ensure_table(engine)

    def close(self) -> None:
        """Nothing is held between calls (the engine's pool is the store's)."""

    # ---------------------------------------------------------------- reading

    def _select(self, conn, *where) -> list[dict]:
        query = (sa.select(COMMIT_LOG.c.row).where(COMMIT_LOG.c.scenario == self.scenario, *where)
                 .order_by(COMMIT_LOG.c.step))
        return [json.loads(text) for text in conn.execute(query).scalars()]

    def _all(self) -> list[dict]:
        try:
            with self.engine.connect() as conn:
                return self._select(conn)
        except sa.exc.DBAPIError as exc:
            raise StorageUnavailable(f"commit log read failed: {exc.orig}") from exc

    def last_step(self) -> int:
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(COMMIT_LOG.c.step), 0))
                                        .where(COMMIT_LOG.c.scenario == self.scenario)).scalar_one())
        except sa.exc.DBAPIError as exc:
            raise StorageUnavailable(f"commit log read failed: {exc.orig}") from exc

    def last_row(self) -> dict | None:
        step = self.last_step()
        return self.row(step) if step else None

    def row(self, step: int) -> dict:
        with self.engine.connect() as conn:
            rows = self._select(conn, COMMIT_LOG.c.step == step)
        if not rows:
            raise ValidationFailed(f"no commit-log row at step {step}")
        return rows[0]

    def rows(self, after_step: int = 0, limit: int = 50, record_id: str | Iterable[str] | None = None) -> list[dict]:
        """Rows with ``step > after_step``, oldest first, at most ``limit``; ``record_id`` as in the file log."""
        if limit < 1:
            raise ValidationFailed("limit must be at least 1")
        wanted = None
        if record_id is not None:
            wanted = {record_id} if isinstance(record_id, str) else set(record_id)
        out = []
        for row in self._all()[max(after_step, 0):]:
            if wanted is not None and not wanted.intersection(row.get("consumed_ids") or ()):
                continue
            out.append(row)
            if len(out) == limit:
                break
        return out

    def consumed_ids(self) -> set[str]:
        return {rid for row in self._all() for rid in row.get("consumed_ids") or ()}

    # ---------------------------------------------------------------- writing

    def adopt(self, earlier) -> int:
        """Copy every row of ``earlier`` (a file log of the same scenario) into this log when this one is empty;
        returns how many rows were copied (0 when this log already has rows)."""
        if self.last_step():
            return 0
        rows = earlier.rows(0, limit=max(earlier.last_step(), 1))
        for row in rows:
            self.append(row, row["step"] - 1)
        return len(rows)

    def append(self, row: dict, expected_step: int) -> dict:
        """Commit ``row`` as step ``expected_step + 1`` (CAS on the step); return the stored row."""
        if not self.writer:
            raise ValidationFailed(f"commit log of {self.scenario!r} is not open for writing")
        normalized = normalize_row(row)
        if "step" in row and row["step"] != expected_step + 1:
            raise ValidationFailed(f"row step {row['step']} does not follow expected step {expected_step}")
        stored = {"step": expected_step + 1, **normalized,
                  "recorded_at": datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")}
        text = json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        try:
            with self.engine.begin() as conn:
                if self.fence is not None:
                    self.fence(conn)
                last = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(COMMIT_LOG.c.step), 0))
                                        .where(COMMIT_LOG.c.scenario == self.scenario)).scalar_one())
                if expected_step == last:
                    inserted = conn.execute(
                        _pg_insert(COMMIT_LOG)
                        .values(scenario=self.scenario, step=expected_step + 1, row=text)
                        .on_conflict_do_nothing().returning(COMMIT_LOG.c.step)).first()
                    if inserted is not None:
                        return stored
                    last = expected_step + 1  # another writer took the step between our read and insert
                if 0 <= expected_step < last:
                    existing = self._select(conn, COMMIT_LOG.c.step == expected_step + 1)
                    if existing and _same(existing[0], normalized):
                        return existing[0]  # identical retry of a committed row
        except sa.exc.DBAPIError as exc:
            raise StorageUnavailable(f"commit log append failed: {exc.orig}") from exc
        raise Conflict(f"commit log of {self.scenario!r} is at step {last}, expected {expected_step}",
                       expected_step=expected_step, last_step=last)
