"""Whole-step barrier for group-synchronous recipes (TTT-Discover, SDPO): one step is a grid of G groups x R rollouts.

Reports. Each rollout is one report quoting its receipt(s), with a finite ``score`` and its grid coordinates in
``metadata``::

    {"score": 0.7, "references": ["<receipt>"],
     "metadata": {"step": 3, "group": 1, "rollout": 5}}       # optional: "groups_per_step": G, "rollouts_per_group": R

``step`` is an integer >= 0, ``group`` in ``[0, G)``, ``rollout`` in ``[0, R)``; G and R are the processor options
``groups`` and ``rollouts_per_group`` (``groups_per_step``/``rollouts_per_group`` in a report, when given, must equal
them). :meth:`GridProcessor.report_key` checks all this at the door of ``POST /reef/report`` (a 400 naming the
field) and names the report's slot, ``reef-grid/<step>/<group>/<rollout>``: the report route stores the report under
that key in the record store's per-scenario key table, inside the write transaction, so a second report for a taken
slot is refused with 409 before anything is stored, race-free and across restarts. Resending the very same report is
a retry and gets the stored receipt back.

Rules, in order:

* **Barrier.** A step is ready only when all G*R slots hold a usable report. A missing slot never trains: the step
  waits (for good, unless ``timeout_s`` is set: then an incomplete step older than ``timeout_s``, timed from its
  first report, is dropped whole as ``incomplete_step``, and a report created after that deadline counts as
  ``step_closed``, so a replay decides the same). A report that makes no sample (a failed or unknown inference, a
  receipt another report holds...) counts under its own reason; as it holds its slot's key, the slot can never
  fill, so its step is dropped whole at once (the step's other reports as ``step_discarded``).
* **One version.** A complete grid whose rollouts were served by more than one version is dropped whole
  (``mixed_versions``, once per rollout). With ``max_staleness`` set, a step with an inadmissible rollout is dropped
  whole too (that rollout under its own reason, the others as ``step_discarded``).
* **Constant groups.** After the barrier, groups whose rewards are all equal carry no gradient and are left out
  (``constant_group``, counted once per rollout when the step is acknowledged or dropped); when every group is
  constant the first one (lowest ``group``) is kept, so the step still trains and the version still advances. The
  left-out reports are consumed with the batch, so they never come back, not even after a restart.
  With ``drop_constant_groups=False`` every group stays in the batch (the recipe decides what constant groups are
  worth, e.g. TTT-Discover still credits their rollouts to its archive before leaving them out of the gradient).
* **Closed steps.** A report for a step that already trained or was dropped counts as ``step_closed``; one for a slot
  already held (stored before a key guarded it) as ``duplicate``.
* **Sequential steps** (``sequential=True``): the door accepts reports only for :meth:`GridProcessor.current_step`
  (the step being filled or trained: the lowest one not closed), a 400 naming ``metadata.step`` otherwise, so a
  client that plans each step from the previous one's result (TTT-Discover's archive) cannot report ahead of it.
  The learner replays the scenario's stream into such a processor before the scenario serves after a restart
  (``replay_at_start``), so the open step is known from the first request.

Batches. One step per batch, lowest complete step first; samples group by group, rollout by rollout. Each sample
keeps the report's metadata (so its coordinates) and gets ``metadata["reef"]["grid"] = {"step", "group", "rollout",
"groups", "rollouts_per_group"}`` and ``group_key = "<step>:<group>"``, so a trainer can compute per-group advantages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from reef_core.errors import ValidationFailed
from reef_core.observe.model import Record
from reef_core.observe.processor import Batch
from reef_core.observe.processors import eligibility as el
from reef_core.observe.processors.base import Unit
from reef_core.observe.processors.per_report import ReportedProcessor

MIXED_VERSIONS = "mixed_versions"
CONSTANT_GROUP = "constant_group"
INCOMPLETE_STEP = "incomplete_step"
STEP_DISCARDED = "step_discarded"
STEP_CLOSED = "step_closed"
NO_COORDINATES = "no_coordinates"

KEY_PREFIX = "reef-grid/"
MAX_STATUS_STEPS = 20


def _index(metadata: dict, name: str, bound: int | None) -> int:
    value = metadata.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (bound is not None and value >= bound):
        what = "an integer >= 0" if bound is None else f"an integer in [0, {bound})"
        raise ValidationFailed(f"metadata.{name} must be {what}, not {value!r}", param=f"metadata.{name}")
    return value


def grid_coordinates(metadata: Any, groups: int, rollouts_per_group: int) -> tuple[int, int, int]:
    """``(step, group, rollout)`` of a report's metadata; :class:`ValidationFailed` naming the bad field."""
    if not isinstance(metadata, dict):
        raise ValidationFailed("a grid report needs metadata {step, group, rollout}", param="metadata")
    for name, expected in (("groups_per_step", groups), ("rollouts_per_group", rollouts_per_group)):
        if name in metadata and (isinstance(metadata[name], bool) or metadata[name] != expected):
            raise ValidationFailed(f"metadata.{name} is {metadata[name]!r} but this scenario's grid has {expected}",
                                   param=f"metadata.{name}")
    return (_index(metadata, "step", None), _index(metadata, "group", groups),
            _index(metadata, "rollout", rollouts_per_group))


@dataclass
class Step:
    """The reports of one step so far, by ``(group, rollout)``."""

    step: int
    started_at: float
    slots: dict[tuple[int, int], Unit] = field(default_factory=dict)


class GridProcessor(ReportedProcessor):
    """The whole-step barrier; see the module docstring. Other arguments as :class:`~.per_report.ReportedProcessor`
    (a score is always required)."""

    name = "grid"

    def __init__(self, scenario: str, *, groups: int, rollouts_per_group: int, timeout_s: float | None = None,
                 drop_constant_groups: bool = True, sequential: bool = False, **kwargs):
        super().__init__(scenario, require_score=True, **kwargs)
        for label, value in (("groups", groups), ("rollouts_per_group", rollouts_per_group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be a positive integer")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        self.groups = groups
        self.rollouts_per_group = rollouts_per_group
        self.timeout_s = float(timeout_s) if timeout_s is not None else None
        for label, value in (("drop_constant_groups", drop_constant_groups), ("sequential", sequential)):
            if not isinstance(value, bool):
                raise ValueError(f"{label} must be true or false")
        self.drop_constant_groups = drop_constant_groups
        self.sequential = sequential
        #: A sequential door depends on the steps the stream closed: the learner replays it before serving.
        self.replay_at_start = sequential
        self._steps: dict[int, Step] = {}  # waiting steps (incomplete and complete)
        self._closed: set[int] = set()  # steps trained or dropped
        self._reserved: Step | None = None  # the step of the reserved batch
        self._left_out: list[Unit] = []  # its constant groups: consumed with the batch, never trained

    @property
    def slots(self) -> int:
        return self.groups * self.rollouts_per_group

    # -- the door -------------------------------------------------------------------------------------------------

    def report_key(self, report: dict) -> str | None:
        if report.get("score") is None:
            raise ValidationFailed("a grid report needs a finite score", param="score")
        if not report.get("references"):
            raise ValidationFailed("a grid report quotes the receipt(s) of its rollout", param="references")
        step, group, rollout = grid_coordinates(report.get("metadata"), self.groups, self.rollouts_per_group)
        if self.sequential:
            current = self.current_step()
            if step != current:
                raise ValidationFailed(f"metadata.step is {step} but this scenario's open step is {current}",
                                       param="metadata.step")
        return f"{KEY_PREFIX}{step}/{group}/{rollout}"

    def current_step(self) -> int:
        """The step now being filled or trained: the reserved one, else the lowest waiting one, else the one after
        the last closed step (0 at the start)."""
        with self._lock:
            if self._reserved is not None:
                return self._reserved.step
            if self._steps:
                return min(self._steps)
            return max(self._closed) + 1 if self._closed else 0

    # -- ingestion --------------------------------------------------------------------------------------------------

    def _coordinates(self, report: Record) -> tuple[int, int, int] | None:
        try:
            return grid_coordinates(report.payload.get("metadata"), self.groups, self.rollouts_per_group)
        except ValidationFailed:
            return None

    def _ingest_report(self, report: Record) -> None:
        coords = self._coordinates(report)
        if report.record_id in self._consumed:
            self._replayed_consumed += 1  # trained before a restart: not a drop, and its step is closed
            if coords is not None:
                self._closed.add(coords[0])
            return
        unit_or_reason = self._unit_for(report)
        if not isinstance(unit_or_reason, str):
            self._admit(unit_or_reason, report)
            return
        self._count_drop(unit_or_reason)
        if coords is None:
            return
        step_no, group, rollout = coords
        step = self._steps.get(step_no)
        if step is not None and (group, rollout) in step.slots:
            return  # a second report for a filled slot: the step is unharmed
        # The report holds its slot's key, so nothing else can fill the slot: the step can never complete.
        if step is not None:
            self._discard(step, {}, STEP_DISCARDED)
        elif self._reserved is None or self._reserved.step != step_no:
            self._closed.add(step_no)

    def _admit(self, unit: Unit, report: Record) -> None:
        coords = self._coordinates(report)
        if coords is None:
            self._count_drop(NO_COORDINATES)
            return
        step_no, group, rollout = coords
        if step_no in self._closed:
            self._count_drop(STEP_CLOSED)
            return
        step = self._steps.get(step_no)
        if step is None and self._reserved is not None and self._reserved.step == step_no:
            step = self._reserved  # complete: whatever comes for it is a duplicate
        if step is None:
            step = self._steps[step_no] = Step(step_no, unit.arrived_at)
        elif self.timeout_s is not None and unit.arrived_at - step.started_at >= self.timeout_s:
            # Past the step's deadline by its own timestamps, not by when it is ingested: a replay after a
            # restart decides as the first pass did.
            self._count_drop(STEP_CLOSED)
            return
        if (group, rollout) in step.slots:
            self._count_drop(el.DUPLICATE)
            return
        grid = {"step": step_no, "group": group, "rollout": rollout, "groups": self.groups,
                "rollouts_per_group": self.rollouts_per_group}
        reef = {**unit.sample.metadata.get("reef", {}), "grid": grid}
        unit.sample = replace(unit.sample, group_key=f"{step_no}:{group}",
                              metadata={**unit.sample.metadata, "reef": reef})
        step.slots[(group, rollout)] = unit
        self._claim(unit)

    # -- steps ------------------------------------------------------------------------------------------------------

    def _complete(self, step: Step) -> bool:
        return len(step.slots) == self.slots

    def _discard(self, step: Step, reasons: dict[int, str], default: str) -> None:
        for unit in step.slots.values():
            self._drop_unit(unit, reasons.get(id(unit), default))
        del self._steps[step.step]
        self._closed.add(step.step)

    def _refresh(self) -> None:
        now = self._clock()
        for step in sorted(self._steps.values(), key=lambda s: s.step):
            if self._complete(step):
                versions = {v for unit in step.slots.values() for v in unit.sample.versions}
                if len(versions) > 1:
                    self._discard(step, {}, MIXED_VERSIONS)
            elif self.timeout_s is not None and now - step.started_at >= self.timeout_s:
                self._discard(step, {}, INCOMPLETE_STEP)

    def recheck_after(self) -> float | None:
        """When the oldest incomplete step times out (never without ``timeout_s``)."""
        if self.timeout_s is None:
            return None
        with self._lock:
            started = [s.started_at for s in self._steps.values() if not self._complete(s)]
            if not started:
                return None
            return max(0.0, min(started) + self.timeout_s - self._clock())

    def _waiting_units(self) -> Iterable[Unit]:
        return [unit for step in sorted(self._steps.values(), key=lambda s: s.step)
                for _, unit in sorted(step.slots.items())]

    def _evict_inadmissible(self, verdicts: dict[int, str]) -> None:
        for step in list(self._steps.values()):
            if any(id(unit) in verdicts for unit in step.slots.values()):
                self._discard(step, verdicts, STEP_DISCARDED)

    def _can_select(self) -> bool:
        return any(self._complete(step) for step in self._steps.values())

    def _select(self) -> list[Unit] | None:
        complete = [step for step in self._steps.values() if self._complete(step)]
        if not complete:
            return None
        step = min(complete, key=lambda s: s.step)
        del self._steps[step.step]
        by_group: dict[int, list[Unit]] = {}
        for (group, _), unit in sorted(step.slots.items()):
            by_group.setdefault(group, []).append(unit)
        varied = [g for g, units in by_group.items() if len({u.sample.reward for u in units}) > 1]
        kept = set(varied) if varied else {min(by_group)}
        if not self.drop_constant_groups:
            kept = set(by_group)
        self._reserved = step
        self._left_out = [u for g, units in by_group.items() if g not in kept for u in units]
        return [u for g, units in by_group.items() if g in kept for u in units]

    def _make_batch(self, units: list[Unit]) -> Batch:
        # The left-out constant groups are consumed with the batch (their ids follow the trained ones).
        batch = super()._make_batch(units + self._left_out)
        return replace(batch, samples=[u.sample for u in units])

    def _put_back(self, units: list[Unit]) -> None:
        step, self._reserved, self._left_out = self._reserved, None, []
        if step is not None:
            self._steps[step.step] = step

    def _batch_done(self) -> None:
        for unit in self._left_out:
            self._claimed.difference_update(unit.claims)
        if self._left_out:
            self._count_drop(CONSTANT_GROUP, len(self._left_out))
        if self._reserved is not None:
            self._closed.add(self._reserved.step)
        self._reserved, self._left_out = None, []

    def protected_ids(self) -> set[str]:
        with self._lock:
            return super().protected_ids() | {i for unit in self._left_out for i in unit.record_ids}

    def _status_extra(self) -> dict:
        complete = sum(1 for step in self._steps.values() if self._complete(step))
        return {**super()._status_extra(), "groups": self.groups, "rollouts_per_group": self.rollouts_per_group,
                "timeout_s": self.timeout_s, "current_step": self.current_step(),
                "open_steps": len(self._steps) - complete, "complete_steps": complete,
                # reports held per waiting step, for the lowest MAX_STATUS_STEPS steps
                "steps": {str(s.step): len(s.slots)
                          for s in sorted(self._steps.values(), key=lambda s: s.step)[:MAX_STATUS_STEPS]},
                "closed_steps": len(self._closed)}

