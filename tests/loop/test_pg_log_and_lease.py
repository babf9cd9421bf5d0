"""The PostgreSQL commit log (compare-and-swap on the step), learner leases and head followers, on a real database."""

from __future__ import annotations

import threading

import pytest

from reef_core.commit.pg_log import PgCommitLog
from reef_core.errors import Conflict, ValidationFailed
from reef_core.loop.follower import HeadWatcher, ScenarioFollower, head_channel, notify_head_moved
from reef_core.loop.lease import LeaseHolder, psycopg_dsn
from reef_core.testing.fixtures import wait_until

pytestmark = pytest.mark.postgres


def row(n: int, **extra) -> dict:
    return {"operation": "training", "release_id": None, "consumed_ids": [f"r{n}"], **extra}


def test_append_is_a_compare_and_swap_on_the_step(pg_schema_engine, tmp_path):
    engine, _ = pg_schema_engine
    log = PgCommitLog(engine, "s", tmp_path)
    other = PgCommitLog(engine, "s", tmp_path)  # a second process's view of the same scenario
    assert log.last_step() == 0 and log.last_row() is None
    first = log.append(row(1), 0)
    assert first["step"] == 1 and other.last_step() == 1
    assert log.append(row(1), 0) == first  # an identical retry returns the stored row
    with pytest.raises(Conflict):
        other.append(row(9), 0)  # a stale writer loses
    with pytest.raises(Conflict):
        log.append(row(2), 5)  # no gaps
    log.append(row(2), 1)
    assert [r["step"] for r in other.rows(0, 10)] == [1, 2]
    assert other.rows(0, 10, "r2")[0]["step"] == 2
    assert other.consumed_ids() == {"r1", "r2"}
    assert PgCommitLog(engine, "t", tmp_path).last_step() == 0  # scenarios keep their own steps
    with pytest.raises(ValidationFailed):
        PgCommitLog(engine, "s", tmp_path, writer=False).append(row(3), 2)


def test_a_file_log_is_adopted_once(pg_schema_engine, tmp_path):
    from reef_core.commit.commitlog import CommitLog

    engine, _ = pg_schema_engine
    earlier = CommitLog.for_scenario(tmp_path, "s")
    earlier.append(row(1), 0)
    earlier.append(row(2), 1)
    shared = PgCommitLog(engine, "s", tmp_path)
    assert shared.adopt(earlier) == 2 and shared.adopt(earlier) == 0
    assert shared.consumed_ids() == {"r1", "r2"} and shared.last_step() == 2


def test_racing_writers_commit_each_step_once(pg_schema_engine, tmp_path):
    engine, _ = pg_schema_engine
    logs = [PgCommitLog(engine, "race", tmp_path) for _ in range(4)]
    wins: list[int] = []

    def write(i: int) -> None:
        try:
            logs[i].append(row(100 + i), 0)
            wins.append(i)
        except Conflict:
            pass

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and logs[0].last_step() == 1
    assert logs[0].row(1)["consumed_ids"] == [f"r{100 + wins[0]}"]


def test_one_lease_per_scenario_and_it_passes_on_when_the_session_ends(pg_schema_engine):
    engine, schema = pg_schema_engine
    first, second = LeaseHolder(engine, schema), LeaseHolder(engine, schema)
    try:
        assert first.try_acquire("a") and first.try_acquire("a")
        assert not second.try_acquire("a")
        assert second.try_acquire("b")  # leases are per scenario
        first.release("a")
        assert second.try_acquire("a")
        assert not first.try_acquire("a")
        second.close()  # a dead process's session ends: its leases go with it (once its backend exits)
        wait_until(lambda: first.try_acquire("a") and first.try_acquire("b"), timeout=10, what="the leases freed")
        assert first.alive()
    finally:
        first.close()
        second.close()


def test_an_append_is_fenced_by_the_lease(pg_schema_engine, tmp_path):
    engine, schema = pg_schema_engine
    holder, rival = LeaseHolder(engine, schema), LeaseHolder(engine, schema)
    try:
        assert holder.try_acquire("s")
        log = PgCommitLog(engine, "s", tmp_path, fence=holder.fence("s"))
        log.append(row(1), 0)
        holder.release("s")  # as if its session had been cut: another learner takes over
        assert rival.try_acquire("s")
        with pytest.raises(Conflict, match="no longer holds the learner lease"):
            log.append(row(2), 1)
        assert PgCommitLog(engine, "s", tmp_path, fence=rival.fence("s")).append(row(2), 1)["step"] == 2
    finally:
        holder.close()
        rival.close()


class _Head:
    def __init__(self, release_id):
        self.release_id = release_id


class _Artifacts:
    """A stand-in for the shared repository: the head is whatever the test sets."""

    def __init__(self):
        self.heads: dict[str, str] = {}

    def head(self, scenario):
        found = self.heads.get(scenario)
        return _Head(found) if found else None

    def read_files(self, release_id):
        return {"system_prompt.md": release_id.encode()}


class _Surface:
    def __init__(self):
        self.served: dict[str, str] = {}

    def activate(self, scenario, release_id, payload=None, files=None):
        assert files().get("system_prompt.md") == release_id.encode()
        self.served[scenario] = release_id

    def serving_version(self, scenario):
        return self.served.get(scenario)


class _Recipe:
    name = "steps"
    trainer = "t"


@pytest.mark.parametrize("notify", [True, False], ids=["notify", "polling"])
def test_followers_serve_the_head_after_a_move(pg_schema_engine, notify):
    engine, schema = pg_schema_engine
    artifacts, surface = _Artifacts(), _Surface()
    artifacts.heads["s"] = "rel-1"
    follower = ScenarioFollower("s", _Recipe(), surface, artifacts)
    follower.start()
    assert surface.served["s"] == "rel-1" and follower.status()["current_release_id"] == "rel-1"
    # Polling alone every 30 s: a move seen at once can only come from the notification.
    interval = 30.0 if notify else 0.2
    watcher = HeadWatcher(lambda: {"s": follower}, interval, dsn=psycopg_dsn(engine) if notify else None,
                          channel=head_channel(schema))
    watcher.start()
    try:
        if notify:
            assert watcher.listening.wait(5)
        artifacts.heads["s"] = "rel-2"
        if notify:
            notify_head_moved(engine, schema, "s")
        wait_until(lambda: surface.served["s"] == "rel-2", timeout=5, interval=0.05, what="the follower moving")
    finally:
        watcher.stop()
    with pytest.raises(Conflict):
        follower.republish("rollback", "rel-1")
