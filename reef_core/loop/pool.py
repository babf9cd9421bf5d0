"""A small pool of worker threads that serves the learners of every scenario.

A scenario costs no thread while it has nothing to do: its learner asks for a turn
(:meth:`LearnerPool.schedule`) when a record is stored, or for a turn later
(:meth:`LearnerPool.schedule_later`) when something time-based may change (a retry after a
failure, a group timeout). The pool guarantees:

* one scenario never runs on two workers at once; a request that arrives while it runs gives
  it one more turn afterwards (requests coalesce: ten wakes while busy make one more turn);
* turns are served first come, first served, and a learner does one unit of work per turn (an
  ingest and at most one training step), so a scenario with slow training takes its turn
  again at the back of the queue and cannot starve the others beyond one step per worker;
* at most ``workers`` threads exist, started on first need; an idle pool waits on a condition
  variable without a timeout (no polling) unless a delayed turn is due.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("reef.learner")

Turn = Callable[[], None]


class LearnerPool:
    def __init__(self, workers: int = 2, name: str = "reef-learner"):
        if workers < 1:
            raise ValueError("a learner pool needs at least one worker")
        self.workers = workers
        self.name = name
        self._cond = threading.Condition()
        self._queue: deque[str] = deque()  # keys waiting for a worker, in arrival order
        self._turns: dict[str, Turn] = {}  # key -> what its turn runs
        self._queued: set[str] = set()
        self._running: set[str] = set()
        self._again: set[str] = set()  # asked for a turn while running
        self._delayed: list[tuple[float, int, str]] = []  # (due, tie-break, key), a heap
        self._due: dict[str, float] = {}  # key -> its one pending delayed turn (the earliest asked for)
        self._tie = itertools.count()
        self._threads: list[threading.Thread] = []
        self._closed = False

    # -- asking for turns ------------------------------------------------------------------------

    def register(self, key: str, turn: Turn) -> None:
        """Make ``turn`` what runs when ``key`` is scheduled (replacing a previous registration)."""
        with self._cond:
            self._turns[key] = turn

    def unregister(self, key: str) -> None:
        """Forget ``key``: its pending turns are dropped; a turn already running finishes."""
        with self._cond:
            self._turns.pop(key, None)
            self._queued.discard(key)
            self._again.discard(key)
            self._due.pop(key, None)
            # Stale entries in the queue and the heap are skipped when they come up.

    def schedule(self, key: str) -> None:
        """Give ``key`` a turn as soon as a worker is free (one more turn if it is running now)."""
        with self._cond:
            if self._closed or key not in self._turns:
                return
            if key in self._running:
                self._again.add(key)
            elif key not in self._queued:
                self._enqueue(key)

    def schedule_later(self, key: str, delay_s: float) -> None:
        """Give ``key`` a turn after ``delay_s`` seconds (a no-op if it gets one earlier anyway)."""
        with self._cond:
            if self._closed or key not in self._turns:
                return
            due = time.monotonic() + max(0.0, delay_s)
            if self._due.get(key, float("inf")) <= due:
                return  # an earlier delayed turn is pending: it serves this request too
            self._due[key] = due
            heapq.heappush(self._delayed, (due, next(self._tie), key))
            if not self._threads:
                self._start_worker()
            self._cond.notify()

    def busy(self, key: str) -> bool:
        """Whether ``key`` runs or waits for a worker now."""
        with self._cond:
            return key in self._running or key in self._queued

    def _enqueue(self, key: str) -> None:  # lock held
        self._queued.add(key)
        self._queue.append(key)
        if len(self._threads) < self.workers and len(self._threads) < len(self._queue) + len(self._running):
            self._start_worker()
        self._cond.notify()

    def _start_worker(self) -> None:  # lock held
        thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- workers ---------------------------------------------------------------------------------

    def _next(self) -> tuple[str, Turn] | None:
        """The next key to run and its turn (None when the pool closes); waits without polling."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    due, _, key = heapq.heappop(self._delayed)
                    if self._due.get(key) != due:
                        continue  # superseded by an earlier delayed turn, or the key was forgotten
                    del self._due[key]
                    if key in self._turns and key not in self._queued:
                        if key in self._running:
                            self._again.add(key)
                        else:
                            self._queued.add(key)
                            self._queue.append(key)
                while self._queue:
                    key = self._queue.popleft()
                    self._queued.discard(key)
                    turn = self._turns.get(key)
                    if turn is None or key in self._running:
                        continue
                    self._running.add(key)
                    return key, turn
                self._cond.wait(self._delayed[0][0] - now if self._delayed else None)

    def _work(self) -> None:
        while True:
            picked = self._next()
            if picked is None:
                return
            key, turn = picked
            try:
                turn()
            except Exception:  # noqa: BLE001 - a turn handles its own errors; this keeps the worker alive
                log.exception("learner turn of %s failed", key)
            finally:
                with self._cond:
                    self._running.discard(key)
                    if key in self._again:
                        self._again.discard(key)
                        if key in self._turns and key not in self._queued:
                            self._enqueue(key)  # at the back: the others waiting go first
                    self._cond.notify_all()  # wait_idle callers, and a worker free for a queued key

    def wait_idle(self, key: str, timeout: float | None = None) -> bool:
        """Wait until ``key`` neither runs nor waits; True if it got there in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key in self._running or key in self._queued or key in self._again:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float = 30) -> None:
        """Stop the workers after their current turns."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
