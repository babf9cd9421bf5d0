"""Scale-out on one machine: two serving replicas and separate learners sharing PostgreSQL and a git remote.

Two ``reef serve server.learner=false`` processes and ``reef learn`` processes share one PostgreSQL schema (records,
idempotency keys, the commit log, learner leases) and one bare git repository used as the artifact remote (each
process works through its own mirror). The recipe is a harness whose trainer (``StepTrainer``) writes which records
each step trained on, and can be held mid-step so the test kills the active learner there. The provider is
FakeUpstream in its own process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest
import sqlalchemy as sa

from reef_core.commit.pg_log import PgCommitLog
from reef_core.testing.fixtures import REEF, ReefProcess, _postgres_available, wait_until

pytestmark = pytest.mark.postgres

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
FOLLOW_S = 1.0
RELEASE = "x-reef-release-id"
RECEIPT = "x-reef-agent-record-id"


@pytest.fixture
def cluster(tmp_path, fake_upstream_url):
    """Shared overrides (fresh schema, fresh remote) and the processes started, stopped at teardown."""
    if not _postgres_available():
        pytest.skip("PostgreSQL is not reachable at 127.0.0.1:5432")
    schema = f"scale_{uuid.uuid4().hex[:12]}"
    remote = tmp_path / "remote.git"
    subprocess.run(["git", "init", "--bare", "-q", str(remote)], check=True)
    overrides = [
        "engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
        f"storage.records_url={PG_URL}", f"storage.records_schema={schema}",
        f"storage.artifact_repository=file://{remote}",
        "recipe.name=steps", "recipe.processor=per_report", "+recipe.processor_options.batch_size=1",
        "recipe.trainer=reef_core.testing.step_trainer:StepTrainer", "recipe.surface=harness",
        f"server.follow_interval_s={FOLLOW_S}",
    ]
    started: list = []
    engine = sa.create_engine(PG_URL).execution_options(schema_translate_map={None: schema})
    yield {"overrides": overrides, "tmp": tmp_path, "started": started, "engine": engine}
    for proc in started:
        if isinstance(proc, ReefProcess):
            proc.stop()
        elif proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    with sa.create_engine(PG_URL).begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def replica(cluster, name: str) -> ReefProcess:
    proc = ReefProcess(cluster["tmp"] / name, [*cluster["overrides"], "server.learner=false"])
    cluster["started"].append(proc)
    return proc.start()


def learner(cluster, name: str, delay_s: float) -> subprocess.Popen:
    data_dir = cluster["tmp"] / name
    data_dir.mkdir()
    markers = cluster["tmp"] / "steps"
    markers.mkdir(exist_ok=True)
    env = {"REEF_TEST_STEP_DIR": str(markers), "REEF_TEST_STEP_DELAY_S": str(delay_s)}
    log = open(cluster["tmp"] / f"{name}.log", "ab")
    proc = subprocess.Popen([*REEF, "learn", f"storage.data_dir={data_dir}", *cluster["overrides"]],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    cluster["started"].append(proc)
    return proc


def chat(server: ReefProcess, scenario: str, text: str, headers: dict | None = None) -> httpx.Response:
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          headers={"x-reef-scenario": scenario, **(headers or {})},
                          json={"model": "m", "messages": [{"role": "user", "content": text}]}, timeout=30)
    assert response.status_code == 200, response.text
    return response


def report(server: ReefProcess, scenario: str, receipt: str, score: float) -> str:
    response = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario},
                          json={"score": score, "references": [receipt]}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["agent_record_id"]


def records(server: ReefProcess, scenario: str) -> list[dict]:
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/records", timeout=30).json()["records"]


def test_replicas_share_records_and_follow_a_learner_that_fails_over(cluster):
    sc = "scale"
    r1, r2 = replica(cluster, "r1"), replica(cluster, "r2")
    log = PgCommitLog(cluster["engine"], sc, cluster["tmp"], writer=False)

    # One Idempotency-Key, alternating replicas: one record, one receipt; an SDK retry on the other replica too.
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    receipts = {chat(server, sc, "hello", key).headers[RECEIPT] for server in (r1, r2, r1)}
    assert len(receipts) == 1
    retry = {chat(r1, sc, "again").headers[RECEIPT],
             chat(r2, sc, "again", {"x-stainless-retry-count": "1"}).headers[RECEIPT]}
    assert len(retry) == 1
    # The same key on both replicas at once: both answered, one record (the key's row is locked at write time).
    raced_key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    with ThreadPoolExecutor(2) as pool:
        raced = set(pool.map(lambda server: chat(server, sc, "at once", raced_key).headers[RECEIPT], (r1, r2)))
    assert len(raced) == 1
    inferences = [r for r in records(r2, sc) if r["request_type"] != "report"]
    assert sorted(r["agent_record_id"] for r in inferences) == sorted(receipts | retry | raced)

    # The learner takes the scenario, seeds its release 0, and both replicas serve it.
    active = learner(cluster, "learn-a", delay_s=20)
    wait_until(lambda: log.last_step() >= 1, timeout=60, what="the learner's creation release")

    def serving(server) -> str | None:
        return chat(server, sc, "which release?").headers.get(RELEASE)

    def both_serve(row: dict) -> float:
        """Seconds from the row's commit until both replicas serve its release (an upper bound: polled)."""
        release_id = row["release_id"]
        wait_until(lambda: serving(r1) == release_id and serving(r2) == release_id,
                   timeout=FOLLOW_S + 5, interval=0.1, what=f"both replicas serving {release_id}")
        return time.time() - datetime.fromisoformat(row["recorded_at"].replace("Z", "+00:00")).timestamp()

    both_serve(log.last_row())

    # A standby learner waits while the active one holds the lease.
    standby = learner(cluster, "learn-b", delay_s=0)
    first = report(r1, sc, next(iter(receipts)), 1.0)
    markers = cluster["tmp"] / "steps"
    wait_until(lambda: any(markers.glob(f"{active.pid}-*.started")), timeout=30, what="the active learner's step")
    started = next(markers.glob(f"{active.pid}-*.started"))
    assert first in json.loads(started.read_text())
    killed_step = int(started.stem.split("-")[1])

    # SIGKILL mid-step: the step never committed; the standby takes over and trains that batch as the same step.
    active.send_signal(signal.SIGKILL)
    active.wait(timeout=10)
    assert not (markers / f"{active.pid}-{killed_step}.trained").exists()
    wait_until(lambda: log.last_step() >= killed_step, timeout=30, what="the standby committing the step")
    row = log.row(killed_step)
    assert row["release_id"] and set(json.loads(started.read_text())) == set(row["consumed_ids"])
    # The stated bound: server.follow_interval_s (a lost NOTIFY) plus a git fetch; NOTIFY makes it far less.
    assert both_serve(row) <= FOLLOW_S + 2

    # The standby (now active) keeps going: another report, another step, no gap, nothing consumed twice.
    second = report(r2, sc, next(iter(retry)), 0.5)
    wait_until(lambda: log.last_step() >= killed_step + 1, timeout=30, what="the next step")
    rows = log.rows(0, limit=100)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    consumed = [rid for r in rows for rid in r["consumed_ids"]]
    assert len(consumed) == len(set(consumed))
    assert {first, second} <= set(consumed)
    assert both_serve(rows[-1]) <= FOLLOW_S + 2
    assert standby.poll() is None


def test_two_full_servers_share_the_learning_and_the_survivor_takes_over(cluster):
    """Two default ``reef serve`` (learner in process) on one database: one trains, the other serves as a follower
    and wakes nothing; records sent to the follower are trained by the other's learner; SIGKILL the training one and
    the survivor's learner takes over."""
    sc = "duo"
    first = ReefProcess(cluster["tmp"] / "a", cluster["overrides"])
    cluster["started"].append(first)
    first.start()
    receipt = chat(first, sc, "hello").headers[RECEIPT]
    log = PgCommitLog(cluster["engine"], sc, cluster["tmp"], writer=False)
    wait_until(lambda: log.last_step() >= 1, timeout=30, what="release 0")
    second = ReefProcess(cluster["tmp"] / "b", cluster["overrides"])
    cluster["started"].append(second)
    second.start()
    assert httpx.get(f"{second.url}/reef/scenarios/{sc}/status").json()["learner"] == "elsewhere"

    trained_by_first = report(second, sc, receipt, 1.0)
    wait_until(lambda: log.last_step() >= 2, timeout=FOLLOW_S + 10, what="the first server training a record "
               "stored by the second")
    assert trained_by_first in log.row(2)["consumed_ids"]

    first.kill()
    wait_until(lambda: httpx.get(f"{second.url}/reef/scenarios/{sc}/status").json()["learner"] != "elsewhere",
               timeout=FOLLOW_S + 10, what="the survivor taking over")
    trained_by_second = report(second, sc, chat(second, sc, "again").headers[RECEIPT], 0.5)
    wait_until(lambda: log.last_step() >= 3, timeout=30, what="the survivor's step")
    rows = log.rows(0, limit=100)
    assert [r["step"] for r in rows] == [1, 2, 3] and trained_by_second in rows[2]["consumed_ids"]
    # The row commits before the head moves and the release activates: serving follows within moments.
    wait_until(lambda: chat(second, sc, "which?").headers.get(RELEASE) == rows[2]["release_id"], timeout=10,
               what="the survivor serving its release")
