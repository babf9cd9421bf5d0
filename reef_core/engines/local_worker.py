"""The local engine's worker: one thread running the engine's torch work in submission order, with consecutive
generations decoded together as one batch.

Two kinds of work are queued: *calls* (load, weight swaps, adapter changes, token counts: run alone) and
*generations*. A generation at the head of the queue joins the running batch when the :class:`Batcher` says it fits
(same adapter, a free row); the generations joining at one step are prefilled together, then decoded with the
others, one forward per step. A call at the head closes the batch to newcomers: the rows in flight finish, then the
call runs. So everything submitted before a call is served by what was there before it, everything after it by what
it made, and no generation spans two weight versions -- the ordering a single-file executor gave, with batching
inside each run of generations.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Protocol


class Batcher(Protocol):
    """What the worker needs from the engine (all called on the worker thread)."""

    def fits(self, keys: list[Any], job: Any) -> Any:
        """``job``'s batch key when it may join rows whose keys are ``keys`` (empty: no batch yet), else None."""

    def admit(self, jobs: list[tuple[Any, Any]]) -> list[Any]:
        """Start ``jobs`` (with their batch keys: tokenize, prefill): their rows, None for each that ended already
        (refused, or done)."""

    def step(self, rows: list[Any]) -> list[Any]:
        """Sample one token for every row, then one forward for those still going; returns those."""


class _Call:
    __slots__ = ("fn", "args", "future")

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args, self.future = fn, args, Future()


class Worker:
    """One daemon thread draining a queue of calls and generations (see the module docstring)."""

    def __init__(self, batcher: Batcher, name: str = "reef-local-engine"):
        self._batcher = batcher
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the worker after everything queued before it; its outcome in the future."""
        item = _Call(fn, args)
        self._put(item)
        return item.future

    def generate(self, job: Any) -> None:
        """Queue a generation (it reports its own outcome, through the batcher)."""
        self._put(job)

    def _put(self, item) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine's worker is stopped")
            self._queue.append(item)
            self._cv.notify()

    def stop(self) -> None:
        """Blocking: let the queued work finish, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    def _loop(self) -> None:
        rows: list = []
        keys: list = []
        while True:
            call = None
            admit: list = []
            with self._cv:
                while not self._queue and not rows:
                    if self._stopping:
                        return
                    self._cv.wait()
                if not rows and isinstance(self._queue[0], _Call):
                    call = self._queue.popleft()
                else:
                    while self._queue and not isinstance(self._queue[0], _Call):
                        key = self._batcher.fits(keys + [k for _, k in admit], self._queue[0])
                        if key is None:
                            break
                        admit.append((self._queue.popleft(), key))
            if call is not None:
                if call.future.set_running_or_notify_cancel():
                    try:
                        call.future.set_result(call.fn(*call.args))
                    except BaseException as exc:  # handed to the caller
                        call.future.set_exception(exc)
                continue
            if admit:
                for row, (_, key) in zip(self._batcher.admit(admit), admit):
                    if row is not None:
                        rows.append(row)
                        keys.append(key)
            if rows:
                going = self._batcher.step(rows)
                keys = [k for r, k in zip(rows, keys) if any(r is g for g in going)]
                rows = going
