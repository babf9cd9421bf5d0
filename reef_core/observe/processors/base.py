"""Shared machinery of the built-in processors: lock, ledger, batch reservation, drops and status.

A *unit* is one candidate sample plus the record ids it consumes. Subclasses decide how records become units and
which units form the next batch; this base owns everything else:

* dedup of the stream (:class:`SeenRecords`): a record delivered twice (a replay overlapping live ingestion, a
  retried append notifying again) is ignored, even when live records arrive slightly out of sequence order;
* the ledger: ``consumed`` ids (from :meth:`restore` and :meth:`acknowledge`) and ``claimed`` receipts (held by a
  pending unit or the reserved batch), so a receipt trains at most once and a second report quoting a pending
  receipt is counted as a duplicate;
* the staleness policy (see :mod:`.eligibility`), applied to waiting units whenever the serving version changes;
* batch reservation: :meth:`pending_batch` returns the same :class:`Batch` until ``acknowledge``/``drop``/``release``;
* drop counters by reason (a :class:`~reef_core.observe.processor.DropCounter`), reported by :meth:`status` and
  :meth:`dropped`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from reef_core.errors import NotFound, ValidationFailed
from reef_core.observe.model import Record
from reef_core.observe.processor import Batch, DropCounter, Processor, Sample, ServingVersion
from reef_core.observe.processors.eligibility import ALREADY_CONSUMED, DUPLICATE, StalenessPolicy


@dataclass
class Unit:
    """One candidate sample and the ids it stands for."""

    sample: Sample
    #: ids acknowledging the unit consumes (its receipts, then its report id when there is one)
    record_ids: tuple[str, ...]
    #: receipts the unit claims: no other unit may train on them while this one is held
    claims: tuple[str, ...]
    #: wall-clock time the unit's source arrived (record.created_at), for timeouts
    arrived_at: float
    #: the serving version the unit was last found admissible under (skip re-checking until it changes)
    checked_under: str | None = field(default=None, repr=False)
    #: store sequence of the record that made the unit (its report), when stored
    sequence: int | None = None


class SeenRecords:
    """Which records were ingested, in bounded memory.

    Store sequences are gap-free per scenario, so "seen" is every sequence up to ``floor`` plus a set of the ones
    above it that arrived early (live notifications of one group commit may run in any order). Should a gap never
    fill, the set is capped: past ``window`` entries the floor jumps to just below the oldest of them. Records
    without a sequence (built in memory, not stored) are remembered by id.
    """

    def __init__(self, window: int = 4096):
        self.window = window
        self.floor = 0
        self._above: set[int] = set()
        self._ids: set[str] = set()

    def first_time(self, record: Record) -> bool:
        """Whether ``record`` was not seen before (and remember it)."""
        seq = record.sequence
        if seq is None:
            if record.record_id in self._ids:
                return False
            self._ids.add(record.record_id)
            return True
        if seq <= self.floor or seq in self._above:
            return False
        self._above.add(seq)
        if len(self._above) > self.window:
            self.floor = min(self._above) - 1
        while self.floor + 1 in self._above:
            self.floor += 1
            self._above.discard(self.floor)
        return True


class BufferedProcessor(Processor):
    """Base of the built-in processors (see the module docstring). Subclasses implement the ``_``-hooks; every
    hook runs with ``self._lock`` held."""

    def __init__(self, scenario: str, *, max_staleness: int | None = None,
                 serving_version: ServingVersion | None = None, clock: Callable[[], float] = time.time):
        super().__init__(scenario)
        self._staleness = StalenessPolicy(max_staleness, serving_version)  # ValueError on a bad setting
        self._clock = clock
        self._lock = threading.RLock()
        self._seen = SeenRecords()
        self._consumed: set[str] = set()
        self._claimed: set[str] = set()
        self._drops = DropCounter(scenario)
        self._batch: Batch | None = None
        self._batch_units: list[Unit] = []
        self._last_ack: tuple[str, list[str]] | None = None
        self._batches_acknowledged = 0
        self._batches_dropped = 0
        self._batches_released = 0
        self._samples_acknowledged = 0
        self._ingested = 0
        self._replayed_consumed = 0

    # -- subclass hooks (lock held) -------------------------------------------------------------------------------

    @abstractmethod
    def _ingest(self, record: Record) -> None:
        """Turn one new record into units (or drops)."""

    @abstractmethod
    def _waiting_units(self) -> Iterable[Unit]:
        """Every unit waiting (not in the reserved batch)."""

    @abstractmethod
    def _evict_inadmissible(self, verdicts: dict[int, str]) -> None:
        """Remove the units whose ``id()`` maps to a staleness reason (counting drops with :meth:`_drop_unit`)."""

    @abstractmethod
    def _select(self) -> list[Unit] | None:
        """Take the units of the next batch out of the waiting set, or return ``None`` if none is ready."""

    @abstractmethod
    def _can_select(self) -> bool:
        """Whether :meth:`_select` would return units now."""

    @abstractmethod
    def _put_back(self, units: list[Unit]) -> None:
        """Return released units to the waiting set, ahead of newer ones."""

    def _refresh(self) -> None:
        """Time-based housekeeping before a readiness decision (partial groups, expired sessions)."""

    def _before_select(self) -> None:
        """Slow work the learner's thread may do before a batch forms (a judge); called WITHOUT the lock."""

    def _status_extra(self) -> dict:
        return {}

    def _forget(self, record_ids: list[str]) -> None:
        """Consumed ids left the processor: drop whatever else was kept for them (held inferences...)."""

    def _batch_done(self) -> None:
        """The reserved batch was acknowledged or dropped (its units are gone for good)."""

    # -- helpers for subclasses -------------------------------------------------------------------------------------

    def _count_drop(self, reason: str, n: int = 1) -> None:
        """Count ``n`` samples that will never train (WARNING the first time per reason; see :class:`DropCounter`)."""
        self._drops.drop(reason, n)

    def _drop_unit(self, unit: Unit, reason: str) -> None:
        """Forget a waiting unit without training it; its receipts become claimable again."""
        self._claimed.difference_update(unit.claims)
        self._count_drop(reason)

    def _claim(self, unit: Unit) -> None:
        self._claimed.update(unit.claims)

    def _claim_conflict(self, claims: Iterable[str]) -> str | None:
        """``already_consumed`` or ``duplicate`` when one of ``claims`` cannot be claimed, else ``None``."""
        claims = list(claims)
        if any(c in self._consumed for c in claims):
            return ALREADY_CONSUMED
        if any(c in self._claimed for c in claims):
            return DUPLICATE
        return None

    # -- Processor API ----------------------------------------------------------------------------------------------

    @property
    def last_sequence(self) -> int:
        """Every store sequence up to this one was ingested: resume with ``store.replay(scenario, last_sequence)``."""
        with self._lock:
            return self._seen.floor

    def ingest(self, record: Record) -> None:
        if record.scenario != self.scenario:
            raise ValidationFailed(f"record {record.record_id!r} belongs to scenario {record.scenario!r}, "
                                   f"not {self.scenario!r}")
        with self._lock:
            if not self._seen.first_time(record):
                return
            self._ingested += 1
            self._ingest(record)

    def ready(self) -> bool:
        self._before_select()
        with self._lock:
            if self._batch is not None:
                return True
            self._prepare()
            return self._admissible_now() and self._can_select()

    def pending_batch(self) -> Batch | None:
        self._before_select()
        with self._lock:
            if self._batch is not None:
                return self._batch
            self._prepare()
            units = self._select() if self._admissible_now() else None
            if not units:
                return None
            self._batch_units = units
            self._batch = self._make_batch(units)
            return self._batch

    def acknowledge(self, batch_id: str) -> list[str]:
        with self._lock:
            repeat = self._repeated_ack(batch_id)
            if repeat is not None:
                return repeat
            batch = self._consume(batch_id)
            self._batches_acknowledged += 1
            self._samples_acknowledged += len(batch.samples)
            return list(batch.record_ids)

    def drop(self, batch_id: str, reason: str) -> list[str]:
        with self._lock:
            repeat = self._repeated_ack(batch_id)
            if repeat is not None:
                return repeat
            batch = self._consume(batch_id)
            self._batches_dropped += 1
            self._count_drop(str(reason), len(batch.samples))
            return list(batch.record_ids)

    def release(self, batch_id: str) -> None:
        with self._lock:
            self._take(batch_id)
            units, self._batch_units = self._batch_units, []
            for unit in units:
                unit.checked_under = None  # re-check staleness before they form a batch again
            self._put_back(units)
            self._batches_released += 1

    def dropped(self) -> dict[str, int]:
        return self._drops.counts()

    def restore(self, consumed_ids: set[str]) -> None:
        with self._lock:
            fresh = set(consumed_ids) - self._consumed
            self._consumed.update(fresh)
            if not fresh:
                return
            # Units ingested before the restore that touch consumed ids can never train.
            verdicts = {id(u): ALREADY_CONSUMED for u in self._waiting_units() if fresh.intersection(u.record_ids)}
            if verdicts:
                self._evict_inadmissible(verdicts)
            self._forget(sorted(fresh))

    def protected_ids(self) -> set[str]:
        with self._lock:
            ids = {i for unit in self._waiting_units() for i in unit.record_ids}
            ids.update(i for unit in self._batch_units for i in unit.record_ids)
            return ids

    def preview(self, limit: int = 20) -> list[Sample]:
        with self._lock:
            reserved = list(self._batch.samples) if self._batch is not None else []
            waiting = [unit.sample for unit in self._waiting_units()]
            return (reserved + waiting)[:limit]

    def status(self) -> dict:
        with self._lock:
            self._refresh()
            waiting = list(self._waiting_units())
            serving = self._staleness.serving() if self._staleness.enabled else None
            return {
                "processor": self.name,
                "scenario": self.scenario,
                "ready": self._batch is not None or (self._admissible_now() and self._can_select()),
                "pending_units": len(waiting),
                "batch": ({"batch_id": self._batch.batch_id, "samples": len(self._batch.samples)}
                          if self._batch is not None else None),
                "dropped": self._drops.counts(),
                "consumed": len(self._consumed),
                "batches_acknowledged": self._batches_acknowledged,
                "samples_acknowledged": self._samples_acknowledged,
                "batches_dropped": self._batches_dropped,
                "batches_released": self._batches_released,
                "records_ingested": self._ingested,
                "replayed_consumed": self._replayed_consumed,
                "last_sequence": self._seen.floor,
                "max_staleness": self._staleness.max_staleness,
                "serving_version": serving,
                "waiting_for_serving_version": self._staleness.enabled and serving is None and bool(waiting),
                **self._status_extra(),
            }

    # -- internals --------------------------------------------------------------------------------------------------

    def _prepare(self) -> None:
        self._refresh()
        if not self._staleness.enabled:
            return
        serving = self._staleness.serving()
        if serving is None:
            return
        verdicts: dict[int, str] = {}
        for unit in self._waiting_units():
            if unit.checked_under == serving:
                continue
            why = self._staleness.reason(unit.sample.versions, serving)
            if why is None:
                unit.checked_under = serving
            else:
                verdicts[id(unit)] = why
        if verdicts:
            self._evict_inadmissible(verdicts)

    def _admissible_now(self) -> bool:
        """With a staleness check configured, units may only form batches once the serving version is known."""
        return not self._staleness.enabled or self._staleness.serving() is not None

    def _make_batch(self, units: list[Unit]) -> Batch:
        ids = list(dict.fromkeys(i for unit in units for i in unit.record_ids))
        digest = hashlib.sha256("\x00".join(ids).encode("utf-8")).hexdigest()[:16]
        return Batch(batch_id=f"{self.scenario}:{self.name}:{digest}", samples=[u.sample for u in units],
                     record_ids=ids, scenario=self.scenario)

    def _repeated_ack(self, batch_id: str) -> list[str] | None:
        """The ids of the batch acknowledged (or dropped) last, when ``batch_id`` names it again: a learner that
        retries after a crash between acknowledging and marking consumed gets the same answer."""
        if self._last_ack is not None and self._last_ack[0] == batch_id and (
                self._batch is None or self._batch.batch_id != batch_id):
            return list(self._last_ack[1])
        return None

    def _consume(self, batch_id: str) -> Batch:
        batch = self._take(batch_id)
        ids = list(batch.record_ids)
        self._consumed.update(ids)
        for unit in self._batch_units:
            self._claimed.difference_update(unit.claims)
        self._batch_units = []
        self._forget(ids)
        self._batch_done()
        self._last_ack = (batch_id, ids)
        return batch

    def _take(self, batch_id: str) -> Batch:
        if self._batch is None or self._batch.batch_id != batch_id:
            raise NotFound(f"batch {batch_id!r} is not the pending batch of scenario {self.scenario!r}",
                           batch_id=batch_id)
        batch, self._batch = self._batch, None
        return batch
