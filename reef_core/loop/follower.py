"""Serving a scenario whose learner runs elsewhere: follow its head, train nothing.

A serving replica (``server.learner=false``), or a ``reef serve`` whose scenario's lease another process
holds, gives each scenario a :class:`ScenarioFollower` instead of a learner. It activates the head of the
shared artifact repository and re-reads it when told (a PostgreSQL ``NOTIFY`` from the learner that moved it)
or every ``server.follow_interval_s`` seconds (:class:`HeadWatcher`), so a head move reaches every replica
within that bound even when a notification is lost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from ..errors import Conflict

log = logging.getLogger("reef.follow")


def head_channel(schema: str | None) -> str:
    """The ``LISTEN``/``NOTIFY`` channel of head moves for the record store's schema."""
    return f"reef_heads_{schema or 'public'}"


class ScenarioFollower:
    """Serves the head of ``scenario`` as the shared artifact repository names it."""

    processor = None  # nothing is ingested here
    has_trainer = False
    #: The recipe's processor, built only for its door rule on reports (``Processor.report_key``), or None.
    door = None

    def __init__(self, scenario: str, recipe, surface, artifacts, commit_log=None):
        self.name = scenario
        self.recipe = recipe
        self.surface = surface
        self.artifacts = artifacts
        self.log = commit_log  # readable when it is shared (PostgreSQL); None for a file log elsewhere
        self.release_id: str | None = None
        self.last_error: str | None = None
        self.refreshed_at: float | None = None
        self._mutex = threading.Lock()

    def start(self) -> None:
        self.refresh()

    def refresh(self) -> bool:
        """Activate the head when it moved; True when what serves changed."""
        with self._mutex:
            try:
                head = self.artifacts.head(self.name)
                self.refreshed_at = time.time()
                if head is None or head.release_id == self.release_id:
                    return False
                if self.surface is not None:
                    release_id = head.release_id
                    self.surface.activate(self.name, release_id,
                                          files=lambda: self.artifacts.read_files(release_id))
                self.release_id = head.release_id
                self.last_error = None
                log.info("scenario %s follows head %s", self.name, head.release_id)
                return True
            except Exception as exc:  # noqa: BLE001 - keep serving what served; retried on the next refresh
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("scenario %s: could not follow the head: %s", self.name, self.last_error)
                return False

    # -- the learner's duck type, as the deployment and routes use it ---------------------------------

    def stop(self, timeout: float = 30) -> None:
        """Nothing runs in the background per scenario."""

    def wake(self) -> None:
        """Records are trained by the learner process; nothing to wake here."""

    def served(self, version: str | None) -> None:
        """Publish latency is measured by the learner that published."""

    def serving_version(self) -> str | None:
        return self.surface.serving_version(self.name) if self.surface is not None else None

    def current_release_id(self) -> str | None:
        return self.release_id

    def republish(self, operation: str, release_id: str, note: dict | None = None):
        raise Conflict(f"scenario {self.name!r} is trained by another process (this one only serves it): "
                       f"send the {operation} to the server running its learner")

    def release_rows(self) -> list[dict]:
        rows = []
        for release in self.artifacts.releases(self.name):
            row = release.to_dict()
            row["current"] = release.release_id == self.release_id
            rows.append(row)
        return rows

    def commit_rows(self, after_step: int, limit: int, record_ids) -> list[dict]:
        if self.log is None:
            raise Conflict(f"the commit log of {self.name!r} is kept by the process running its learner")
        return self.log.rows(after_step, limit, record_ids)

    def status(self) -> dict:
        return {"scenario": self.name, "recipe": self.recipe.name, "learner": "elsewhere",
                "step": self.log.last_step() if self.log is not None else None,
                "current_release_id": self.release_id, "current_version": self.serving_version(),
                "trainer": self.recipe.trainer, "last_error": self.last_error,
                "followed_at": self.refreshed_at}


class HeadWatcher:
    """Refreshes followers: at once on a head-move notification, and all of them every ``interval_s``.

    ``dsn`` (PostgreSQL) enables ``LISTEN``; without it (or while the listening session is down) polling alone
    keeps the bound. ``on_round`` runs after every periodic refresh (the deployment's own round of work)."""

    def __init__(self, followers: Callable[[], dict[str, ScenarioFollower]], interval_s: float,
                 dsn: str | None = None, channel: str | None = None, on_round: Callable[[], None] | None = None):
        self._followers = followers
        self._on_round = on_round
        self.interval_s = interval_s
        self._dsn = dsn
        self._channel = channel
        self._stop = threading.Event()
        #: Set while a ``LISTEN`` session is up (a move notified from then on is seen at once).
        self.listening = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reef-head-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def refresh(self, scenario: str | None = None) -> None:
        for name, follower in list(self._followers().items()):
            if scenario is None or name == scenario:
                follower.refresh()

    def _poll(self) -> None:
        self.refresh()
        if self._on_round is not None:
            try:
                self._on_round()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("head watcher round failed")

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._dsn is not None:
                try:
                    self._listen()
                except Exception as exc:  # noqa: BLE001 - fall back to polling, then listen again
                    self.listening.clear()
                    log.warning("head notifications unavailable (%s); polling every %.1f s", exc, self.interval_s)
            self._poll()
            self._stop.wait(self.interval_s)

    def _listen(self) -> None:
        import psycopg

        with psycopg.connect(self._dsn, autocommit=True) as conn:
            conn.execute(f'LISTEN "{self._channel}"')
            self.listening.set()
            self.refresh()  # moves made before LISTEN took effect
            next_poll = time.monotonic() + self.interval_s
            while not self._stop.is_set():
                timeout = max(0.0, next_poll - time.monotonic())
                for note in conn.notifies(timeout=min(timeout, 1.0), stop_after=1):
                    try:
                        scenario = json.loads(note.payload).get("scenario")
                    except (ValueError, AttributeError):
                        scenario = None
                    self.refresh(scenario)
                if time.monotonic() >= next_poll:
                    self._poll()
                    next_poll = time.monotonic() + self.interval_s


def notify_head_moved(engine, schema: str | None, scenario: str) -> None:
    """Tell every listening replica that ``scenario``'s head moved (best effort: they also poll)."""
    import sqlalchemy as sa

    try:
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:channel, :payload)"),
                         {"channel": head_channel(schema), "payload": json.dumps({"scenario": scenario})})
    except Exception as exc:  # noqa: BLE001
        log.warning("could not notify replicas of %s's head move: %s", scenario, exc)
