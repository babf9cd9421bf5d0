"""Idle scenarios cost no thread, no open file and no CPU: learners sleep until a record wakes them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from reef_core.testing.fixtures import wait_until

SCENARIOS = 200


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_many_idle_scenarios_stay_cheap(reef_server, fake_upstream_url):
    # per_report: every stored record wakes the scenario's learner, which ingests it on the pool.
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                         "recipe.processor=per_report")
    pid = server.proc.pid
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        def chat(scenario: str) -> None:
            response = client.post("/v1/chat/completions", headers={"x-reef-scenario": scenario}, json=body)
            assert response.status_code == 200, response.text

        chat("warm-up")  # the first scenario opens the record store, the commit directory, the pool
        wait_until(lambda: client.get("/reef/status").json()["scenarios"]["warm-up"]["records_seen"] > 0, 60)
        threads_before, fds_before = _threads(pid), _fds(pid)
        for i in range(SCENARIOS):
            chat(f"idle-{i}")

        def settled():
            scenarios = client.get("/reef/status").json()["scenarios"]
            mine = [s for name, s in scenarios.items() if name.startswith("idle-")]
            return len(mine) == SCENARIOS and all(s["records_seen"] > 0 and s["learner"] == "idle" for s in mine)

        wait_until(settled, 120)  # every learner ingested its record and went back to sleep
        threads, fds = _threads(pid), _fds(pid)
        assert threads < 30 and threads - threads_before <= 4, (threads_before, threads)
        assert fds - fds_before < 20, (fds_before, fds)
        # An idle server burns (almost) no CPU: no learner polls the database.
        start = _cpu_s(pid)
        time.sleep(3)  # the measurement window itself, not a wait for a condition
        assert _cpu_s(pid) - start < 0.09  # 3% of a core; 200 polling learners cost ~7%
        # Every scenario still learns on demand: a new record wakes its learner at once.
        chat("idle-7")
        wait_until(lambda: client.get("/reef/scenarios/idle-7/status").json()["records_seen"] >= 2, 30)
