"""Rate limits and token budgets per token and per scenario, with usage kept in the record store.

Limits (see :mod:`reef_core.serve.middleware.tenancy` for the config): ``rpm`` requests and ``tpm`` tokens (input + output
as the engine's usage reports them, counted when the answer is recorded) over the last 60 seconds, and
``budget_tokens`` per ``budget_period`` (``day`` and ``month`` in UTC, or ``total``). An inference request is
checked before the engine is called, against what is already spent: over any limit it is refused with 429 and a
``retry-after`` (seconds until the window or period frees enough; a spent ``total`` budget gets none).

Why not a limiter library: ``limits`` (the maintained one) is not in the environment's registry mirror, and a token
count is only known after the answer, which needs a post-hoc weighted hit and an injectable clock for tests. The
windows below are exact sliding logs of ``(time, amount)``: a request log holds at most ``rpm`` entries, a token
log one entry per answer of the last minute.

Persistence: counters (tokens and requests per key and period) live in the ``usage_counters`` table. They are
loaded at start-up and flushed by a background task every ``FLUSH_S`` seconds and at shutdown, as increments
(an upsert adding the delta), so replicas on one PostgreSQL store add up. In a process the in-memory counters are
authoritative; what other replicas spent arrives with each flush's read-back, so across replicas a budget can be
overrun by what they spend within one flush interval. The request path never waits for the database. The
per-minute windows are per process and start empty after a restart. Each flush also reads the current periods' rows back (one small
query every ``FLUSH_S`` seconds, off the request path), which is how a replica that spent nothing lately learns
what the others did.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import math
import time
from collections import deque
from typing import Callable

from reef_core.errors import RateLimited
from reef_core.serve.middleware.tenancy import Limits, Principal, Tenancy

log = logging.getLogger("reef.serve")

WINDOW_S = 60.0
FLUSH_S = 2.0


class SlidingWindow:
    """Amounts added over the last ``WINDOW_S`` seconds."""

    __slots__ = ("events", "total")

    def __init__(self):
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def used(self, now: float) -> int:
        events = self.events
        while events and events[0][0] <= now - WINDOW_S:
            self.total -= events.popleft()[1]
        return self.total

    def add(self, now: float, amount: int) -> None:
        if amount:
            self.used(now)  # trims: a window nobody checks (a token without limits) stays a minute long
            self.events.append((now, amount))
            self.total += amount

    def wait_below(self, now: float, limit: int) -> float:
        """Seconds until the amount in the window drops below ``limit``."""
        left = self.used(now)
        for at, amount in self.events:
            left -= amount
            if left < limit:
                return at + WINDOW_S - now
        return 0.0


def period_key(period: str, now: float) -> str:
    if period == "total":
        return "total"
    return time.strftime("%Y-%m-%d" if period == "day" else "%Y-%m", time.gmtime(now))


def period_ends_in(period: str, now: float) -> float | None:
    """Seconds until the period after ``now`` starts (``None`` for ``total``, which never ends)."""
    if period == "total":
        return None
    t = time.gmtime(now)
    if period == "day":
        start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)) + 86400
    else:
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        start = calendar.timegm((year, month, 1, 0, 0, 0))
    return start - now


class Bucket:
    """The counters of one key: a token (``token:<name>``) or a limited scenario (``scenario:<name>``)."""

    def __init__(self, key: str, limits: Limits | None):
        self.key = key
        self.limits = limits
        self.period = limits.budget_period if limits is not None and limits.budget_tokens is not None else "total"
        self.requests = SlidingWindow()
        self.tokens = SlidingWindow()
        #: period key -> [tokens, requests]: stored totals (all replicas, as of the last flush) and not yet flushed
        self.base: dict[str, list[int]] = {}
        self.pending: dict[str, list[int]] = {}

    def spent(self, now: float) -> tuple[str, int, int]:
        pk = period_key(self.period, now)
        base, pending = self.base.get(pk, (0, 0)), self.pending.get(pk, (0, 0))
        return pk, base[0] + pending[0], base[1] + pending[1]

    def refusal(self, now: float, what: str) -> RateLimited | None:
        limits = self.limits
        if limits is None:
            return None
        if limits.rpm is not None and self.requests.used(now) >= limits.rpm:
            return _limited(f"{what} is over its limit of {limits.rpm} requests per minute",
                            self.requests.wait_below(now, limits.rpm), "rpm")
        if limits.tpm is not None and self.tokens.used(now) >= limits.tpm:
            return _limited(f"{what} is over its limit of {limits.tpm} tokens per minute",
                            self.tokens.wait_below(now, limits.tpm), "tpm")
        if limits.budget_tokens is not None and self.spent(now)[1] >= limits.budget_tokens:
            period = "in total" if self.period == "total" else f"per {self.period}"
            return _limited(f"{what} has spent its budget of {limits.budget_tokens} tokens {period}",
                            period_ends_in(self.period, now), "budget_tokens")
        return None

    def count(self, now: float, requests: int, tokens: int) -> None:
        if requests:
            self.requests.add(now, requests)
        if tokens:
            self.tokens.add(now, tokens)
        row = self.pending.setdefault(period_key(self.period, now), [0, 0])
        row[0] += tokens
        row[1] += requests


def _limited(message: str, retry_after: float | None, limit: str) -> RateLimited:
    seconds = None if retry_after is None else max(1, math.ceil(retry_after))
    return RateLimited(message, retry_after=seconds, limit=limit)


class Usage:
    """Every bucket of a deployment; ``clock`` is injectable for tests."""

    def __init__(self, tenancy: Tenancy, clock: Callable[[], float] = time.time):
        self.tenancy = tenancy
        self.clock = clock
        self.buckets: dict[str, Bucket] = {}
        self._flusher: asyncio.Task | None = None

    def _bucket(self, key: str, limits: Limits | None) -> Bucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket(key, limits)
        return bucket

    def _buckets_of(self, principal: Principal, scenario: str) -> list[tuple[Bucket, str]]:
        found = []
        if principal.name != "open":
            found.append((self._bucket(f"token:{principal.name}", principal.limits), f"token {principal.name!r}"))
        rule = self.tenancy.scenario_limit(scenario)
        if rule is not None:
            found.append((self._bucket(f"scenario:{scenario}", rule[1]), f"scenario {scenario!r}"))
        return found

    def admit(self, principal: Principal, scenario: str) -> None:
        """Refuse (:class:`RateLimited`) a request over any of its limits; else count it."""
        buckets = self._buckets_of(principal, scenario)
        if not buckets:
            return
        now = self.clock()
        for bucket, what in buckets:
            refused = bucket.refusal(now, what)
            if refused is not None:
                raise refused
        for bucket, _ in buckets:
            bucket.count(now, 1, 0)

    def spend(self, principal: Principal, scenario: str, tokens: int) -> None:
        """Count the tokens of an answer (input + output as its usage reports them)."""
        if tokens <= 0:
            return
        now = self.clock()
        for bucket, _ in self._buckets_of(principal, scenario):
            bucket.count(now, 0, tokens)

    def snapshot(self, names: set[str] | None = None) -> dict:
        """Per-token usage for ``GET /reef/status`` (tokens named in ``names``, or all)."""
        now = self.clock()
        out = {}
        for key, bucket in list(self.buckets.items()):
            kind, _, name = key.partition(":")
            if kind != "token" or (names is not None and name not in names):
                continue
            pk, tokens, requests = bucket.spent(now)
            limits = bucket.limits
            out[name] = {"requests_last_minute": bucket.requests.used(now),
                         "tokens_last_minute": bucket.tokens.used(now),
                         "period": pk, "tokens": tokens, "requests": requests,
                         "limits": None if limits is None else {
                             "rpm": limits.rpm, "tpm": limits.tpm, "budget_tokens": limits.budget_tokens,
                             "budget_period": limits.budget_period}}
        return out

    # -- persistence ---------------------------------------------------------------------------------------------

    def _known_buckets(self) -> None:
        """Buckets of every configured principal and of scenarios already stored with a limit rule."""
        for principal in self.tenancy.principals():
            self._bucket(f"token:{principal.name}", principal.limits)

    def load(self, store) -> None:
        """Read the stored counters of the current periods (start-up)."""
        self._known_buckets()
        now = self.clock()
        for key, period, tokens, requests in store.usage_rows(self._current_periods()):
            if key.startswith("scenario:"):
                rule = self.tenancy.scenario_limit(key.partition(":")[2])
                if rule is None:
                    continue
                bucket = self._bucket(key, rule[1])
            else:
                bucket = self.buckets.get(key)
                if bucket is None:
                    continue  # a token no longer configured
            if period == period_key(bucket.period, now):
                bucket.base[period] = [tokens, requests]

    def take_pending(self) -> list[tuple[str, str, int, int]]:
        """The unflushed increments, moved into the buckets' base (run on the event loop's thread)."""
        rows = []
        for bucket in list(self.buckets.values()):
            pending, bucket.pending = bucket.pending, {}
            for pk, (tokens, requests) in pending.items():
                rows.append((bucket.key, pk, tokens, requests))
                base = bucket.base.setdefault(pk, [0, 0])
                base[0] += tokens
                base[1] += requests
        return rows

    def apply_totals(self, totals: dict[tuple[str, str], tuple[int, int]]) -> None:
        """Set the bases to the stored totals read back after a flush (other replicas' spending included). A
        limited scenario only another replica has served gets its bucket here."""
        now = self.clock()
        for (key, pk), (tokens, requests) in totals.items():
            bucket = self.buckets.get(key)
            if bucket is None and key.startswith("scenario:"):
                rule = self.tenancy.scenario_limit(key.partition(":")[2])
                bucket = self._bucket(key, rule[1]) if rule is not None else None
            if bucket is not None and pk == period_key(bucket.period, now):
                bucket.base = {pk: [tokens, requests]}

    def _current_periods(self) -> list[str]:
        now = self.clock()
        return sorted({period_key(p, now) for p in ("day", "month", "total")})

    def _sync(self, store, rows) -> list[tuple[str, str, int, int]]:
        """Add the increments, then read every counter of the current periods back (a worker thread's part)."""
        if rows:
            store.add_usage(rows)
        return store.usage_rows(self._current_periods())

    async def flush(self, store) -> None:
        """Store the increments and take in the totals, other replicas' spending included (every ``FLUSH_S``:
        one small write when something was spent, one read of the current periods' rows)."""
        rows = self.take_pending()
        stored = await asyncio.to_thread(self._sync, store, rows)
        self.apply_totals({(key, period): (tokens, requests) for key, period, tokens, requests in stored})

    async def start(self, store) -> None:
        await asyncio.to_thread(self.load, store)
        self._flusher = asyncio.create_task(self._flush_loop(store))

    async def _flush_loop(self, store) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush(store)
            except Exception:  # noqa: BLE001 - the increments were moved to base: logged, retried never twice
                log.exception("could not store token usage")

    async def stop(self, store) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            try:
                await self._flusher
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._flusher = None
        try:
            await self.flush(store)
        except Exception:  # noqa: BLE001
            log.exception("could not store token usage at shutdown")
