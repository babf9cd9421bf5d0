"""The processor contract: how a scenario's record stream becomes training batches.

A processor sees every stored record of its scenario, in store order (inference and report records alike), and
turns them into :class:`Batch` objects of :class:`Sample` items for the learner. Two threads use it: the request
path (or a replay) calls :meth:`Processor.ingest`, the learner calls :meth:`~Processor.ready`,
:meth:`~Processor.pending_batch` and then exactly one of :meth:`~Processor.acknowledge` (trained),
:meth:`~Processor.drop` (will never train, e.g. the serving fence moved) or :meth:`~Processor.release` (not now;
put the units back). Implementations guard their state with a lock and never block ``ingest``.

Lifecycle of a batch::

    if processor.ready():
        batch = processor.pending_batch()        # the same object until acknowledged, dropped or released
        ... train on batch.samples ...
        consumed = processor.acknowledge(batch.batch_id)
        store.mark_consumed(scenario, consumed, step)

Recovery: a new processor gets ``restore(store.consumed_ids(scenario))`` before the replay, so nothing a commit
already consumed trains twice.

Samples are dialect-free: messages are OpenAI-style chat turns (``{"role", "content"}``, plus ``tool_calls`` /
``tool_call_id`` when the turn has them) whatever dialect the client or engine spoke.
"""

from __future__ import annotations

import logging
import math
import threading
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

from reef_core.observe.model import Record

log = logging.getLogger("reef.dropped")

#: A judge of a (turn, next turn) pair: a score, ``"wait"`` (ask again later) or ``"never"`` (drop the turn).
#: A dict ``{"score": float, "feedback"?: ..., "metadata"?: {...}}`` scores with extra data; ``{"never": reason}``
#: drops the turn counted under ``reason`` (status ``dropped``).
JudgeResult = Union[float, int, Literal["wait", "never"], dict]
Judge = Callable[[Record, Record], JudgeResult]

#: Returns the artifact version currently serving the scenario (``"<incarnation>:<seq>"``), or ``None``.
ServingVersion = Callable[[], Union[str, None]]


@dataclass(frozen=True)
class Segment:
    """One assistant turn of a sample, and the inference record that produced it.

    The turn is ``Sample.messages[message_index]``; the prompt the model saw for it is
    ``Sample.messages[context_start:message_index]`` (``context_start`` is 0 unless the client rewrote its history
    between two turns of the trajectory, e.g. after a compaction).
    """

    message_index: int
    record_id: str
    version: str | None
    context_start: int = 0
    #: token data captured by the engine: ``{"prompt_ids", "output_ids", "output_logprobs", "version"}``
    tokens: dict | None = None

    def to_dict(self) -> dict:
        return {"message_index": self.message_index, "record_id": self.record_id, "version": self.version,
                "context_start": self.context_start, "tokens": self.tokens}


@dataclass(frozen=True)
class Sample:
    """One training item: a (multi-turn) trajectory with its reward and provenance.

    ``source_ids`` lists every record the sample stands for: the referenced inference ids in order, then the
    report id (when a report produced it).
    """

    scenario: str
    messages: list[dict]
    segments: list[Segment]
    reward: float | None = None
    feedback: Any = None
    metadata: dict = field(default_factory=dict)
    source_ids: list[str] = field(default_factory=list)
    report_id: str | None = None
    group_key: str | None = None

    @property
    def versions(self) -> list[str | None]:
        """The artifact version that produced each assistant turn, in order."""
        return [s.version for s in self.segments]

    @property
    def tokens(self) -> list[dict | None]:
        """Per-turn token data (``None`` for a turn whose engine captured none)."""
        return [s.tokens for s in self.segments]

    @property
    def references(self) -> list[str]:
        """The inference record ids whose replies are the sample's assistant turns."""
        return [s.record_id for s in self.segments]

    @property
    def prompt(self) -> list[dict]:
        """The context of the last assistant turn (the whole prompt for a single-turn sample)."""
        last = self.segments[-1]
        return self.messages[last.context_start:last.message_index]

    @property
    def completion(self) -> str:
        """Text of the last assistant turn."""
        return self.messages[self.segments[-1].message_index].get("content") or ""

    def to_dict(self) -> dict:
        reward = self.reward if self.reward is None or math.isfinite(self.reward) else None
        return {"scenario": self.scenario, "messages": self.messages,
                "segments": [s.to_dict() for s in self.segments], "reward": reward, "feedback": self.feedback,
                "metadata": self.metadata, "source_ids": self.source_ids, "report_id": self.report_id,
                "group_key": self.group_key}


@dataclass(frozen=True)
class Batch:
    """A reserved set of samples; ``record_ids`` are the ids acknowledging it consumes.

    ``instructions`` holds the person's instruction a ``manual`` / ``hybrid`` scenario trains on in this step
    (``{"agent_record_id", "text", "session", "release_id", "requires", "client"}``, see
    :mod:`reef_core.observe.instructions`); empty for a batch formed from traffic alone."""

    batch_id: str
    samples: list[Sample]
    record_ids: list[str]
    scenario: str = ""
    instructions: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def to_dict(self) -> dict:
        out = {"batch_id": self.batch_id, "scenario": self.scenario, "record_ids": self.record_ids,
               "samples": [s.to_dict() for s in self.samples]}
        if self.instructions:
            out["instructions"] = self.instructions
        return out


def drop_reason(reason: object) -> tuple[str, str | None]:
    """``(label, detail)`` of a drop reason: ``"trainer_refused: no log-probs"`` counts under ``trainer_refused``
    (a bounded label for status and ``/metrics``), its detail only in the log line."""
    text = str(reason).strip()
    label, sep, detail = text.partition(":")
    return (label.strip() or "unknown"), (detail.strip() or None) if sep else None


class DropCounter:
    """Samples (or turns) of one scenario that will never train, counted by reason.

    The one counting mechanism of processors and the learner: ``drop(reason, n)`` adds ``n`` under the reason's
    label (see :func:`drop_reason`) and logs a WARNING the first time a reason is counted (once per scenario and
    reason: a steady loss is counted, not logged per sample). :meth:`counts` is what status shows as ``dropped``
    and ``/metrics`` as ``reef_samples_dropped_total{scenario,reason}``. Thread-safe."""

    def __init__(self, scenario: str):
        self.scenario = scenario
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def drop(self, reason: object, n: int = 1) -> None:
        if n <= 0:
            return
        label, _detail = drop_reason(reason)  # the detail is the caller's to log (it may name a record)
        with self._lock:
            first = label not in self._counts
            self._counts[label] += n
        if first:
            log.warning("scenario %s: %d sample(s) dropped without training, reason %s (counted in status "
                        "'dropped' and reef_samples_dropped_total; logged once per scenario and reason)",
                        self.scenario, n, label)

    def counts(self) -> dict[str, int]:
        """Drops so far by reason, sorted by reason."""
        with self._lock:
            return dict(sorted(self._counts.items()))


class Processor(ABC):
    """Turns one scenario's record stream into training batches (see the module docstring).

    Every method is thread-safe. ``ingest`` is cheap and never blocks on I/O or on a judge; the methods the learner
    calls may do slow work (a next-state judge runs there) but never while holding the lock ``ingest`` needs.
    """

    #: registry name of the processor kind
    name: str = "processor"
    #: True: the learner replays the scenario's stored records into the processor before the scenario serves after
    #: a (re)start, not on its first turn (a processor whose door answers from what the stream holds).
    replay_at_start: bool = False

    def __init__(self, scenario: str):
        self.scenario = scenario

    @abstractmethod
    def ingest(self, record: Record) -> None:
        """See one stored record of this scenario. Records arrive in store order; a record seen twice (a replay
        overlapping live ingestion) is ignored."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether :meth:`pending_batch` would return a batch now."""

    @abstractmethod
    def pending_batch(self) -> Batch | None:
        """The batch to train next, or ``None``. The same object until acknowledged, dropped or released."""

    @abstractmethod
    def acknowledge(self, batch_id: str) -> list[str]:
        """The batch trained: forget its units and return the record ids it consumed (report ids and the
        inference ids they referenced). Acknowledging the last acknowledged batch again returns the same ids."""

    @abstractmethod
    def release(self, batch_id: str) -> None:
        """The batch will not train now: put its units back, in their original order."""

    @abstractmethod
    def drop(self, batch_id: str, reason: str) -> list[str]:
        """The batch will never train: acknowledge it without a step, counting ``reason`` once per sample."""

    def dropped(self) -> dict[str, int]:
        """Samples dropped without training, by reason (status ``dropped``, ``reef_samples_dropped_total``). A
        processor counting with a :class:`DropCounter` returns its :meth:`~DropCounter.counts`; by default, the
        ``dropped`` mapping of :meth:`status`."""
        found = self.status().get("dropped")
        if not isinstance(found, dict):
            return {}
        return {str(k): v for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}

    def recheck_after(self) -> float | None:
        """Seconds after which :meth:`ready` may change with no new record (a timeout, a judge to ask again),
        or None. The learner sleeps on new records only; this is how a time-based change gets its turn."""
        return None

    def preview(self, limit: int = 20) -> list["Sample"]:
        """Samples waiting to train (the reserved batch first), without reserving anything."""
        return []

    def report_key(self, report: dict) -> str | None:
        """The door check of ``POST /reef/report``, called before the report is stored: raise
        :class:`~reef_core.errors.ValidationFailed` (400) for a report this processor could never use, and return a
        key the report must hold alone among the scenario's stored reports (a second, different report under the
        same key is refused with 409 inside the write transaction), or ``None`` for no such rule."""
        return None

    @abstractmethod
    def status(self) -> dict:
        """JSON-serialisable state: pending units, ready, the reserved batch, drops by reason, consumed count..."""

    @abstractmethod
    def restore(self, consumed_ids: set[str]) -> None:
        """Recovery: treat ``consumed_ids`` as already trained; they never become (part of) a sample again."""

    def protected_ids(self) -> set[str]:
        """Record ids held by pending units or the reserved batch (retention must keep them)."""
        return set()
