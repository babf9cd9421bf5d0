"""The record store's single writer thread: group commit.

Every write goes through one queue. The thread takes everything that queued while the previous transaction was
committing (up to ``batch_size`` rows), stores it in one transaction, and only after the commit resolves each
caller's future. One fsync thus covers many callers: throughput grows with concurrency instead of being capped by the
disk's fsync rate, while each caller still returns only once its row is durable.

A batch that fails with a database error is rolled back and its requests are retried one by one, each in its own
transaction; a request that still fails gets :class:`~reef_core.errors.StorageUnavailable`. Nothing is dropped,
not even a request whose caller was cancelled while it queued (a client that went away): it was submitted, so it is
written.
Threads wait on a :class:`concurrent.futures.Future`; coroutines on a future of their own event loop, which the writer
resolves through ``loop.call_soon_threadsafe`` (once per loop and batch), so any loop (uvicorn's included) can append.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from reef_core.errors import ReefError, StorageUnavailable
from reef_core.observe.batch import AppendRequest, apply_appends
from reef_core.observe.engine import write_lock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterStats:
    """Counters of the writer since the store opened (a snapshot)."""

    transactions: int  # write transactions committed
    rows: int  # record rows inserted
    batches: int  # append batches attempted
    retried_batches: int  # batches that failed and were retried request by request
    failed_requests: int  # requests whose caller got a storage error
    largest_batch: int  # most append requests committed in one transaction
    pending: int  # requests queued now
    appended: int = 0  # append requests committed in batches (with ``batches``: the mean batch size)
    commit_s: float = 0.0  # seconds spent in committed append transactions (with ``batches``: the mean latency)


class _Call:
    """A non-append write (scenario, consumed ids) run alone in its own transaction."""

    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[sa.Connection], Any]):
        self.fn = fn
        self.future: Future = Future()


class _Append:
    """An append waiting for its commit: a thread waits on a concurrent future, a coroutine on its loop's future."""

    __slots__ = ("request", "future", "loop")

    def __init__(self, request: AppendRequest, loop: asyncio.AbstractEventLoop | None):
        self.request = request
        self.loop = loop
        self.future: Future | asyncio.Future = loop.create_future() if loop is not None else Future()

    def start(self) -> None:
        """Mark a thread's future running, so it can no longer be cancelled. The request is written even when its
        caller stopped waiting (a cancelled coroutine, a client gone): what was submitted is kept, never dropped."""
        if self.loop is None:
            self.future.set_running_or_notify_cancel()


class Writer:
    """Owns the write connection; see the module docstring."""

    def __init__(self, engine: sa.Engine, dialect: str, *, batch_size: int = 500, max_pending: int = 10_000,
                 linger_s: float = 0.002, retry_attempts: int = 2):
        if batch_size < 1 or max_pending < 1 or retry_attempts < 1 or linger_s < 0:
            raise ValueError("batch_size, max_pending and retry_attempts must be positive, linger_s not negative")
        self._linger_s = linger_s
        self._last_batch = 1  # requests in the previous append batch: how many callers to expect back
        self._wake_at = 1  # queue length at which a submission wakes the writer
        self._engine = engine
        self._dialect = dialect
        self._batch_size = batch_size
        self._max_pending = max_pending
        self._retry_attempts = retry_attempts
        self._conn: sa.Connection | None = None  # the writer thread's own connection, held across batches
        self._lock = write_lock(engine)  # other processes writing the same SQLite file queue here
        self._queue: deque[_Call | _Append] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._counts = {"transactions": 0, "rows": 0, "batches": 0, "retried_batches": 0,
                        "failed_requests": 0, "largest_batch": 0, "appended": 0, "commit_s": 0.0}
        # Daemon: a process exiting without close() must not hang; callers not yet answered were never promised.
        self._thread = threading.Thread(target=self._run, name="reef-record-writer", daemon=True)
        self._thread.start()

    # -- submission ---------------------------------------------------------------------------------------------

    def submit_append(self, request: AppendRequest, loop: asyncio.AbstractEventLoop | None = None):
        """Queue an append; the returned future resolves to the stored records once committed.

        With ``loop`` (call from that loop's thread) it is an :class:`asyncio.Future` of that loop, else a
        :class:`concurrent.futures.Future`.
        """
        return self._submit(_Append(request, loop)).future

    def submit_call(self, fn: Callable[[sa.Connection], Any]) -> Future:
        """Queue ``fn(connection)`` to run in its own write transaction; the future resolves to its result."""
        return self._submit(_Call(fn)).future

    def _submit(self, item):
        with self._cond:
            if self._closed:
                raise StorageUnavailable("the record store is closed")
            if len(self._queue) >= self._max_pending:
                raise StorageUnavailable("the record store is overloaded (write queue full); retry later")
            self._queue.append(item)
            # Wake the writer when it idles, or when a lingering writer's batch has filled up.
            if len(self._queue) == 1 or len(self._queue) >= self._wake_at:
                self._cond.notify()
        return item

    def stats(self) -> WriterStats:
        with self._cond:
            return WriterStats(pending=len(self._queue), **self._counts)

    def close(self) -> None:
        """Commit everything already queued, then stop the thread. Later submissions are refused."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # -- the thread ---------------------------------------------------------------------------------------------

    def _take(self) -> list | None:
        """Block for work; return one call, or consecutive appends up to the row budget; None when closed."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            if isinstance(self._queue[0], _Append):
                self._linger()
            first = self._queue.popleft()
            if isinstance(first, _Call):
                return [first]
            taken, rows = [first], len(first.request.records)
            while self._queue and isinstance(self._queue[0], _Append):
                size = len(self._queue[0].request.records)
                if rows + size > self._batch_size:
                    break
                taken.append(self._queue.popleft())
                rows += size
            self._last_batch = len(taken)
            return taken

    def _linger(self) -> None:
        """Under load, wait briefly for the callers just answered to send their next request.

        Without this, the first request to arrive after a commit would get a transaction (and an fsync) of its own
        while the others queue behind it. The wait ends as soon as as many requests are queued as the previous
        batch held, so a lone sequential caller (previous batch of one) never waits.
        """
        target = min(self._last_batch, self._batch_size)
        if self._linger_s <= 0 or len(self._queue) >= target:
            return
        deadline = time.monotonic() + self._linger_s
        self._wake_at = target
        try:
            while len(self._queue) < target and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)
        finally:
            self._wake_at = 1

    @contextmanager
    def _transaction(self) -> Iterator[sa.Connection]:
        """One write transaction (committed on success, rolled back on error).

        The thread keeps one connection across transactions: checking it out of the pool cost CPU per batch (and on
        PostgreSQL a pre-ping round trip), and there is a single writer thread per store anyway (other processes
        still queue on SQLite's lock through ``BEGIN IMMEDIATE``, on PostgreSQL's row locks). After any failure the
        connection is dropped and the next transaction opens a fresh one, so a connection PostgreSQL closed (a
        restart, an idle timeout) fails one batch, whose requests are then retried one by one on new connections.
        """
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._conn = self._engine.connect()
        try:
            with self._lock, self._conn.begin():
                yield self._conn
        except BaseException:
            # After any failure start the next transaction on a fresh connection, as per-batch checkouts did.
            self._release_connection()
            raise

    def _release_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing after a failure must not hide the failure
                log.debug("closing the writer connection failed", exc_info=True)

    def _run(self) -> None:
        try:
            self._loop_forever()
        finally:
            self._release_connection()
            self._lock.close()

    def _loop_forever(self) -> None:
        while True:
            items = self._take()
            if items is None:
                return
            try:
                if isinstance(items[0], _Call):
                    self._run_call(items[0])
                else:
                    self._run_appends(items)
            except BaseException as exc:  # never let the thread die with callers waiting
                log.exception("record writer failed unexpectedly")
                for item in items:
                    if isinstance(item, _Append):
                        item.request.outcome = exc
                        _deliver([item])
                    elif not item.future.done():
                        item.future.set_exception(exc)

    def _bump(self, **deltas: int) -> None:
        with self._cond:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _committed(self, rows: int, requests: int, seconds: float = 0.0) -> None:
        with self._cond:
            self._counts["transactions"] += 1
            self._counts["rows"] += rows
            self._counts["appended"] += requests
            self._counts["commit_s"] += seconds
            self._counts["largest_batch"] = max(self._counts["largest_batch"], requests)

    def _run_call(self, item: _Call) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            with self._transaction() as conn:
                result = item.fn(conn)
        except sa.exc.DBAPIError as exc:
            self._bump(failed_requests=1)
            item.future.set_exception(_storage_error(exc))
        except Exception as exc:
            item.future.set_exception(exc)
        else:
            self._bump(transactions=1)
            item.future.set_result(result)

    def _run_appends(self, items: list[_Append]) -> None:
        for item in items:
            item.start()
        self._bump(batches=1)
        started = time.perf_counter()
        try:
            with self._transaction() as conn:
                rows = apply_appends(conn, self._dialect, [item.request for item in items])
        except sa.exc.DBAPIError as exc:
            log.warning("record batch of %d requests failed (%s); retrying one by one", len(items), exc)
            self._bump(retried_batches=1)
            for item in items:
                item.request.outcome = None
                self._run_single(item)
                _deliver([item])
            return
        self._committed(rows, len(items), time.perf_counter() - started)
        _deliver(items)

    def _run_single(self, item: _Append) -> None:
        """Store one request in its own transaction, setting its outcome (records or the error to raise)."""
        error: sa.exc.DBAPIError | None = None
        for _ in range(self._retry_attempts):  # a second try absorbs a race with another process's insert
            try:
                with self._transaction() as conn:
                    rows = apply_appends(conn, self._dialect, [item.request])
            except sa.exc.DBAPIError as exc:
                error = exc
                continue
            except Exception as exc:
                item.request.outcome = exc
                return
            self._committed(rows, 1)
            return
        self._bump(failed_requests=1)
        item.request.outcome = _storage_error(error)


def _deliver(items: list[_Append]) -> None:
    """Hand each request's outcome to its waiter: one ``call_soon_threadsafe`` per event loop and batch, so a
    batch of N coroutines costs one loop wake-up, not N."""
    per_loop: dict[asyncio.AbstractEventLoop, list[_Append]] = {}
    for item in items:
        if item.loop is None:
            _settle(item)
        else:
            per_loop.setdefault(item.loop, []).append(item)
    for loop, group in per_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_all, group)
        except RuntimeError:  # the loop closed: nobody is waiting any more
            log.debug("event loop closed before %d record outcomes were delivered", len(group))


def _settle_all(items: list[_Append]) -> None:
    for item in items:
        _settle(item)


def _settle(item: _Append) -> None:
    if item.future.done():  # its caller was cancelled: the record is stored all the same
        return
    outcome = item.request.outcome
    if isinstance(outcome, BaseException):
        item.future.set_exception(outcome)
    else:
        item.future.set_result(outcome)


def _storage_error(exc: sa.exc.DBAPIError) -> ReefError:
    error = StorageUnavailable(f"record store write failed: {exc.orig}")
    error.__cause__ = exc
    return error
