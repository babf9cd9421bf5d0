"""Reported feedback, one sample per report: :class:`ReportedProcessor` and :class:`PerReportProcessor`.

A report quoting receipts becomes ONE sample: its referenced inferences, in reference order, merged into one
(multi-turn) trajectory (see :mod:`.samples`), with the report's score as reward, its feedback and metadata, and
``source_ids`` = references + report id. A report that quotes nothing, lacks a required score, quotes a receipt that
already trained (``already_consumed``) or that a pending unit holds (``duplicate``: the first report wins), quotes an
incomplete or failed inference (``incomplete``) or one the processor no longer holds (``unknown_reference``) is
counted as dropped and never trains.

Hold-out (``holdout``, a fraction in [0, 1)): a report whose referenced inference falls in the hold-out never trains.
The choice hashes the inference's record id, so a restart (which replays the same records) holds out the same ones,
and every report quoting that inference is held out with it. A held-out report with a score becomes a replay task
``{id, input, reported_score, metadata}`` (``input``: the chat before the last reply; ``metadata``: the report's),
the newest ``max_replay_tasks`` of them kept, for the gate's ``replay`` evaluator (:meth:`replay_tasks`).

Inference records wait for a report quoting them, at most ``max_held_inferences`` of them (the oldest unquoted ones
are forgotten first; ``status()["inferences_evicted"]``). Only what deciding needs is held per record (:class:`Held`:
id, version, why it cannot train); the bodies are read back through ``load_records`` (the record store) when a report
turns them into a sample. Without ``load_records`` (offline use, tests) the whole records are kept instead.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from reef_core.observe.compacted import is_compacted
from reef_core.observe.model import Record
from reef_core.observe.processor import ServingVersion
from reef_core.observe.processors import eligibility as el
from reef_core.observe.processors.base import BufferedProcessor, Unit
from reef_core.observe.processors.conversation import UnusableRecord
from reef_core.observe.processors.samples import trajectory_sample

log = logging.getLogger("reef.observe.processors")

DEFAULT_MAX_HELD_INFERENCES = 50_000
DEFAULT_MAX_REPLAY_TASKS = 256


def in_holdout(record_id: str, fraction: float) -> bool:
    """Whether ``record_id`` falls in a hold-out of ``fraction``: a hash of the id, so stable across restarts."""
    if fraction <= 0:
        return False
    point = int.from_bytes(hashlib.sha256(record_id.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64
    return point < fraction

#: Reads stored records by id (``None`` for an id the store no longer has), in the order asked.
RecordLoader = Callable[[Sequence[str]], Sequence[Record | None]]


@dataclass(frozen=True, slots=True)
class Held:
    """What a processor keeps of an inference record while it waits for a report: no payload."""

    record_id: str
    sequence: int | None
    version: str | None
    #: why the record can never train (``incomplete``, ``not_chat``), or ``None``
    unusable: str | None
    created_at: float


class ReportedProcessor(BufferedProcessor):
    """Turns reports (and the inferences they quote) into units; subclasses choose how units form batches.

    Args:
        scenario: the scenario whose records this processor sees.
        max_staleness: ``None`` (no check), or the accepted lag in versions (see :mod:`.eligibility`).
        serving_version: returns the version serving now; required when ``max_staleness`` is set.
        require_score: drop reports without a finite score (reason ``no_score``).
        accept_report: optional filter ``report -> bool`` (the recipe's "is this training data"); refused
            reports count as ``filtered``.
        max_held_inferences: cap on inference records held while waiting for a report.
        load_records: reads quoted inference records back from the store (see the module docstring).
        holdout: fraction of inferences held out of training as replay tasks (see the module docstring).
        max_replay_tasks: how many replay tasks are kept (the newest).
        clock: wall-clock source (``time.time``), injectable for tests.
    """

    def __init__(self, scenario: str, *, max_staleness: int | None = None,
                 serving_version: ServingVersion | None = None, require_score: bool = True,
                 accept_report: Callable[[Record], bool] | None = None,
                 max_held_inferences: int = DEFAULT_MAX_HELD_INFERENCES, load_records: RecordLoader | None = None,
                 holdout: float = 0.0, max_replay_tasks: int = DEFAULT_MAX_REPLAY_TASKS,
                 clock: Callable[[], float] = time.time):
        super().__init__(scenario, max_staleness=max_staleness, serving_version=serving_version, clock=clock)
        if max_held_inferences < 1:
            raise ValueError("max_held_inferences must be positive")
        if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout < 1:
            raise ValueError(f"holdout must be a fraction in [0, 1), got {holdout!r}")
        if isinstance(max_replay_tasks, bool) or not isinstance(max_replay_tasks, int) or max_replay_tasks < 1:
            raise ValueError(f"max_replay_tasks must be a positive integer, got {max_replay_tasks!r}")
        self.holdout = float(holdout)
        self._replay: deque[dict] = deque(maxlen=max_replay_tasks)
        self._held_out = 0
        self.require_score = bool(require_score)
        self.accept_report = accept_report
        self.max_held_inferences = int(max_held_inferences)
        self._inferences: dict[str, Held] = {}
        #: Whole records by id, only when there is no store to read them back from.
        self._bodies: dict[str, Record] | None = {} if load_records is None else None
        self._load_records = load_records
        self._evicted = 0

    # -- ingestion ------------------------------------------------------------------------------------------------

    def _ingest(self, record: Record) -> None:
        if record.kind == "inference":
            self._hold(record)
        elif record.kind == "report":
            self._ingest_report(record)

    def _hold(self, record: Record) -> None:
        if record.record_id in self._consumed:
            return
        self._inferences[record.record_id] = Held(record.record_id, record.sequence, record.version,
                                                  el.unusable_reason(record), record.created_at)
        if self._bodies is not None:
            self._bodies[record.record_id] = record
        while len(self._inferences) > self.max_held_inferences:
            evicted = next(iter(self._inferences))
            self._inferences.pop(evicted)
            if self._bodies is not None:
                self._bodies.pop(evicted, None)
            self._evicted += 1

    def _read_inferences(self, ids: list[str]) -> list[Record] | None:
        """The whole records of ``ids`` (the store's copy), or ``None`` when one is gone."""
        if self._bodies is not None:
            records = [self._bodies.get(i) for i in ids]
        else:
            records = list(self._load_records(ids))
        if len(records) != len(ids) or any(r is None or r.record_id != i for r, i in zip(records, ids)):
            return None
        return records

    def _ingest_report(self, report: Record) -> None:
        if report.record_id in self._consumed:
            self._replayed_consumed += 1  # trained before a restart: not a drop
            return
        unit_or_reason = self._unit_for(report)
        if isinstance(unit_or_reason, str):
            self._count_drop(unit_or_reason)
            return
        if any(in_holdout(ref, self.holdout) for ref in report.references):
            self._hold_out(unit_or_reason)
            return
        self._admit(unit_or_reason, report)

    def _hold_out(self, unit: Unit) -> None:
        """Keep a held-out report as a replay task; it never trains (its records are never consumed)."""
        sample = unit.sample
        self._held_out += 1
        self._forget(list(unit.claims))
        replies = [i for i, m in enumerate(sample.messages) if m.get("role") == "assistant"]
        if sample.reward is None or not replies or replies[-1] == 0:
            return
        metadata = {k: v for k, v in sample.metadata.items() if k != "reef"}
        self._replay.append({"id": sample.report_id, "input": sample.messages[:replies[-1]],
                             "reported_score": float(sample.reward), "metadata": metadata})

    def replay_tasks(self) -> list[dict]:
        """The held-out replay tasks, oldest first (at most ``max_replay_tasks``, the newest)."""
        with self._lock:
            return [dict(task) for task in self._replay]

    def _unit_for(self, report: Record) -> Unit | str:
        """The unit a report makes, or the reason it makes none."""
        refs = list(report.references)
        if not refs:
            return el.NO_REFERENCES
        if self.accept_report is not None:
            try:
                accepted = bool(self.accept_report(report))
            except Exception:  # noqa: BLE001 - a broken filter must not break ingestion
                log.exception("report filter failed on %s", report.record_id)
                accepted = False
            if not accepted:
                return el.FILTERED
        conflict = self._claim_conflict(refs)
        if conflict is not None:
            return conflict
        score = el.report_score(report)
        if self.require_score and score is None:
            return el.NO_SCORE
        for ref in refs:
            held = self._inferences.get(ref)
            if held is None:
                return el.UNKNOWN_REFERENCE
            if held.unusable is not None:
                return held.unusable
        inferences = self._read_inferences(refs)
        if inferences is None:
            return el.UNKNOWN_REFERENCE
        if any(is_compacted(r) for r in inferences):
            return el.COMPACTED
        metadata = report.payload.get("metadata")
        try:
            sample = trajectory_sample(self.scenario, inferences, reward=score,
                                       feedback=report.payload.get("feedback"),
                                       metadata=metadata if isinstance(metadata, dict) else {},
                                       report_id=report.record_id)
        except UnusableRecord:
            return el.NOT_CHAT
        return Unit(sample=sample, record_ids=(*refs, report.record_id), claims=tuple(refs),
                    arrived_at=report.created_at, sequence=report.sequence)

    def _admit(self, unit: Unit, report: Record) -> None:
        """Hold a new unit (subclass: FIFO queue or a group)."""
        raise NotImplementedError

    def _forget(self, record_ids: list[str]) -> None:
        for record_id in record_ids:
            self._inferences.pop(record_id, None)
            if self._bodies is not None:
                self._bodies.pop(record_id, None)

    def _status_extra(self) -> dict:
        return {"held_inferences": len(self._inferences), "inferences_evicted": self._evicted,
                "require_score": self.require_score, "holdout": self.holdout, "held_out": self._held_out,
                "replay_tasks": len(self._replay)}


class PerReportProcessor(ReportedProcessor):
    """One sample per report; a batch is the oldest ``batch_size`` waiting samples, in arrival order.

    Staleness drops single samples (not their neighbours) before the batch forms; see :mod:`.eligibility`.
    :meth:`close_batch` lets a batch form early, with every report stored up to a sequence (a "day" that ends
    before ``batch_size`` sessions were graded).
    """

    name = "per_report"

    def __init__(self, scenario: str, *, batch_size: int = 1, **kwargs):
        super().__init__(scenario, **kwargs)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError("batch_size must be a positive integer")
        self.batch_size = batch_size
        self._queue: deque[Unit] = deque()
        self._close_through: int | None = None
        self._batches_closed = 0

    def _admit(self, unit: Unit, report: Record) -> None:
        self._claim(unit)
        self._queue.append(unit)

    def _waiting_units(self) -> Iterable[Unit]:
        return self._queue

    def _evict_inadmissible(self, verdicts: dict[int, str]) -> None:
        kept: deque[Unit] = deque()
        for unit in self._queue:
            why = verdicts.get(id(unit))
            if why is None:
                kept.append(unit)
            else:
                self._drop_unit(unit, why)
        self._queue = kept

    def close_batch(self, through_sequence: int) -> int:
        """Close the batch early: the next batch holds the waiting units whose report is stored at or below
        ``through_sequence`` (the store's last sequence when the close was asked), up to ``batch_size`` of them,
        even if fewer than ``batch_size``. The close holds until the processor has ingested that far and no such
        unit waits. Returns how many units wait now."""
        if isinstance(through_sequence, bool) or not isinstance(through_sequence, int) or through_sequence < 0:
            raise ValueError("through_sequence must be a non-negative integer")
        with self._lock:
            self._close_through = max(through_sequence, self._close_through or 0)
            return len(self._queue)

    def _closed_units(self) -> int:
        """How many leading waiting units the pending close covers (clearing a close that covers nothing)."""
        through = self._close_through
        if through is None:
            return 0
        count = 0
        for unit in self._queue:
            if unit.sequence is None or unit.sequence > through or count == self.batch_size:
                break
            count += 1
        if count == 0 and self._seen.floor >= through:
            self._close_through = None  # everything up to the close was ingested and batched
        return count

    def _can_select(self) -> bool:
        return len(self._queue) >= self.batch_size or self._closed_units() > 0

    def _select(self) -> list[Unit] | None:
        if len(self._queue) >= self.batch_size:
            return [self._queue.popleft() for _ in range(self.batch_size)]
        count = self._closed_units()
        if count == 0:
            return None
        self._batches_closed += 1
        return [self._queue.popleft() for _ in range(count)]

    def _put_back(self, units: list[Unit]) -> None:
        self._queue.extendleft(reversed(units))

    def _status_extra(self) -> dict:
        return {**super()._status_extra(), "batch_size": self.batch_size, "close_through": self._close_through,
                "batches_closed_early": self._batches_closed}

