"""The learner pool: one turn per scenario at a time, coalesced wakes, fair turns, delayed turns."""

from __future__ import annotations

import threading
import time

from reef_core.loop.pool import LearnerPool
from reef_core.testing.fixtures import wait_until


def test_a_scenario_never_runs_on_two_workers_and_wakes_coalesce():
    pool = LearnerPool(workers=4)
    running, overlaps, turns = [0], [0], [0]
    release = threading.Event()
    lock = threading.Lock()

    def turn():
        with lock:
            running[0] += 1
            overlaps[0] = max(overlaps[0], running[0])
            turns[0] += 1
        release.wait(10)
        with lock:
            running[0] -= 1

    pool.register("s", turn)
    pool.schedule("s")
    wait_until(lambda: turns[0] == 1, 10)
    for _ in range(10):  # wakes while the turn runs make exactly one more turn
        pool.schedule("s")
    release.set()
    assert pool.wait_idle("s", 10)
    assert turns[0] == 2 and overlaps[0] == 1
    pool.close()


def test_a_slow_scenario_does_not_starve_the_others():
    pool = LearnerPool(workers=1)
    order: list[str] = []
    started, proceed = threading.Event(), threading.Event()

    def slow():
        order.append("slow")
        started.set()
        proceed.wait(10)  # a long training step
        if order.count("slow") < 5:
            pool.schedule("slow")  # it always has more work

    pool.register("slow", slow)
    pool.register("quick", lambda: order.append("quick"))
    pool.schedule("slow")
    assert started.wait(10)
    pool.schedule("quick")  # arrives while the slow scenario trains on the only worker
    proceed.set()
    assert pool.wait_idle("slow", 10) and pool.wait_idle("quick", 10)
    # The quick scenario ran right after the slow step in progress, not after all of the slow steps.
    assert order == ["slow", "quick", "slow", "slow", "slow", "slow"], order
    pool.close()


def test_delayed_turns_and_unregistered_keys():
    pool = LearnerPool(workers=2)
    ran: list[float] = []
    pool.register("t", lambda: ran.append(time.monotonic()))
    asked = time.monotonic()
    pool.schedule_later("t", 0.2)
    wait_until(lambda: ran, 10)
    assert ran[0] - asked >= 0.2
    pool.unregister("t")
    pool.schedule("t")
    pool.schedule_later("t", 0)
    assert pool.wait_idle("t", 5) and len(ran) == 1  # a forgotten scenario gets no turn
    pool.close()


def test_threads_are_bounded_and_started_on_need():
    before = threading.active_count()
    pool = LearnerPool(workers=3)
    for i in range(50):
        pool.register(f"s{i}", lambda: time.sleep(0.01))
    assert threading.active_count() == before  # no work yet: no thread
    for i in range(50):
        pool.schedule(f"s{i}")
    assert threading.active_count() <= before + 3
    for i in range(50):
        assert pool.wait_idle(f"s{i}", 10)
    pool.close()
    assert threading.active_count() == before


def test_repeated_delayed_requests_make_one_turn():
    pool = LearnerPool(workers=1)
    ran: list[float] = []
    pool.register("t", lambda: ran.append(time.monotonic()))
    for i in range(1, 6):  # e.g. every record-driven turn asking to look again later
        pool.schedule_later("t", 0.05 * i)
    wait_until(lambda: ran, 10)
    time.sleep(0.4)  # the window in which the later requests would have run
    assert pool.wait_idle("t", 5)
    pool.close()
    assert len(ran) == 1  # the earliest turn answers them all (it asks again if it still needs to)
