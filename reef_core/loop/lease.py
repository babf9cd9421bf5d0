"""One active learner per scenario across processes: PostgreSQL session advisory locks.

A learner process holds one dedicated database session; for each scenario it trains it holds
``pg_try_advisory_lock(key)`` on that session, the key derived from the record store's schema and the
scenario name. The lock lives as long as the session: a learner killed with SIGKILL (or cut off from the
database) drops its session and with it every lock, so a standby process's next
:meth:`LeaseHolder.try_acquire` wins and its learner recovers from the commit log. A learner whose session
broke stops training (:meth:`LeaseHolder.alive` is False) rather than keep writing without the lock, and every
commit-log append is fenced (:meth:`LeaseHolder.fence`): inside its transaction it checks in ``pg_locks`` that
this process's session still holds the scenario's lock, so a learner that lost its lease (a network cut it has
not noticed yet) cannot commit a step after another one took over.
"""

from __future__ import annotations

import hashlib
import logging
import threading

import sqlalchemy as sa

from ..errors import Conflict

log = logging.getLogger("reef.lease")


def lease_key(schema: str | None, scenario: str) -> int:
    """The signed 64-bit advisory-lock key of ``scenario`` in the store's ``schema``."""
    digest = hashlib.blake2b(f"reef-learner\0{schema or ''}\0{scenario}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def psycopg_dsn(engine: sa.Engine) -> str:
    """A libpq connection string for the store's database (psycopg, without SQLAlchemy)."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


class LeaseHolder:
    """The advisory locks this process holds, on one session of its own."""

    def __init__(self, engine: sa.Engine, schema: str | None):
        import psycopg

        self.schema = schema
        self._conn = psycopg.connect(psycopg_dsn(engine), autocommit=True)
        self.backend_pid = self._conn.info.backend_pid
        self._mutex = threading.Lock()
        self._held: set[str] = set()
        self._broken = False

    def try_acquire(self, scenario: str) -> bool:
        """Take the scenario's lease if no other session holds it; True when this process holds it."""
        with self._mutex:
            if scenario in self._held:
                return True
            if self._broken:
                return False
            try:
                got = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (lease_key(self.schema, scenario),)
                                         ).fetchone()[0]
            except Exception as exc:  # noqa: BLE001 - a lost session holds nothing
                self._lost(exc)
                return False
            if got:
                self._held.add(scenario)
            return bool(got)

    def release(self, scenario: str) -> None:
        with self._mutex:
            if scenario not in self._held:
                return
            self._held.discard(scenario)
            if not self._broken:
                try:
                    self._conn.execute("SELECT pg_advisory_unlock(%s)", (lease_key(self.schema, scenario),))
                except Exception as exc:  # noqa: BLE001
                    self._lost(exc)

    def fence(self, scenario: str):
        """``check(conn)`` for :class:`~reef_core.commit.pg_log.PgCommitLog`: raises :class:`Conflict` inside the
        append's transaction unless this process's session holds ``scenario``'s lease."""
        key = lease_key(self.schema, scenario)
        params = {"pid": self.backend_pid, "classid": (key >> 32) & 0xFFFFFFFF, "objid": key & 0xFFFFFFFF}

        def check(conn: sa.Connection) -> None:
            held = conn.execute(sa.text(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = :pid"
                " AND classid::bigint = :classid AND objid::bigint = :objid AND objsubid = 1"), params).first()
            if held is None:
                raise Conflict(f"this process no longer holds the learner lease of scenario {scenario!r}; "
                               "another learner may have taken over", scenario=scenario)

        return check

    def alive(self) -> bool:
        """Whether the session (and so every lease it holds) still stands."""
        with self._mutex:
            if self._broken:
                return False
            try:
                self._conn.execute("SELECT 1")
                return True
            except Exception as exc:  # noqa: BLE001
                self._lost(exc)
                return False

    def _lost(self, exc: BaseException) -> None:
        if not self._broken:
            log.error("learner lease session lost (%s): leases %s are gone", exc, sorted(self._held))
        self._broken = True
        self._held.clear()

    def close(self) -> None:
        with self._mutex:
            self._held.clear()
            try:
                self._conn.close()  # ends the session: every lease is released at once
            except Exception:  # noqa: BLE001
                pass
