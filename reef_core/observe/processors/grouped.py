"""Grouped reported feedback: samples released in groups that share a key (GRPO-style comparison groups).

Each report becomes a sample as in :class:`~.per_report.PerReportProcessor`, then joins the open group of its key:

* ``key="prompt"``: the prompt of the sample's first turn (normalised messages, hashed): same question, several
  rollouts;
* ``key="task"``: ``metadata.task`` of the report, or ``metadata.harbor.task_name``;
* ``key="metadata.<path>"``: any (dotted) field of the report's metadata.

A report without a key is dropped (``no_group_key``). A group is *complete* at ``group_size`` samples and then ready;
the next sample of the same key opens a new group. With ``slot="metadata.<path>"`` a group keeps the first report
per slot value (a retry under another id counts as ``duplicate``). A batch is ``groups_per_batch`` ready groups,
oldest first, their samples group after group.

Partial groups (``partial_policy``), timed from the first report's ``created_at``:

* ``wait`` (default): an incomplete group waits indefinitely;
* ``drop_after_s``: an incomplete group older than ``timeout_s`` is dropped (reason ``group_timeout``);
* ``release_partial``: an incomplete group older than ``timeout_s`` becomes ready as it is, if it has at least
  ``min_partial_size`` samples (else it is dropped, ``group_timeout``); its samples say ``partial: true``.

Staleness is decided per group: when any member of a waiting group is inadmissible, the whole group is discarded;
the offending members count under their own reason (``stale``, ``cross_incarnation``...), the others under
``group_discarded``. So a group never mixes versions further apart than ``max_staleness``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from reef_core.observe.model import Record
from reef_core.observe.processors import eligibility as el
from reef_core.observe.processors.base import Unit
from reef_core.observe.processors.conversation import message_key
from reef_core.observe.processors.per_report import ReportedProcessor

PARTIAL_POLICIES = ("wait", "drop_after_s", "release_partial")
NO_GROUP_KEY = "no_group_key"
GROUP_TIMEOUT = "group_timeout"
GROUP_DISCARDED = "group_discarded"


@dataclass
class Group:
    key: str
    order: int
    started_at: float
    units: list[Unit] = field(default_factory=list)
    slots: set = field(default_factory=set)
    ready: bool = False
    partial: bool = False


def _lookup(data: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


class GroupedProcessor(ReportedProcessor):
    """Samples grouped by key; see the module docstring. Other arguments as :class:`~.per_report.ReportedProcessor`."""

    name = "grouped"

    def __init__(self, scenario: str, *, group_size: int, key: str = "prompt", groups_per_batch: int = 1,
                 partial_policy: str = "wait", timeout_s: float | None = None, min_partial_size: int = 1,
                 slot: str | None = None, **kwargs):
        super().__init__(scenario, **kwargs)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError("group_size must be a positive integer")
        if isinstance(groups_per_batch, bool) or not isinstance(groups_per_batch, int) or groups_per_batch < 1:
            raise ValueError("groups_per_batch must be a positive integer")
        if key not in ("prompt", "task") and not (key.startswith("metadata.") and len(key) > len("metadata.")):
            raise ValueError(f"key must be 'prompt', 'task' or 'metadata.<field>', not {key!r}")
        if slot is not None and not (slot.startswith("metadata.") and len(slot) > len("metadata.")):
            raise ValueError(f"slot must be 'metadata.<field>', not {slot!r}")
        if partial_policy not in PARTIAL_POLICIES:
            raise ValueError(f"partial_policy must be one of {', '.join(PARTIAL_POLICIES)}, not {partial_policy!r}")
        if partial_policy != "wait" and (timeout_s is None or not timeout_s > 0):
            raise ValueError(f"partial_policy {partial_policy!r} needs a positive timeout_s")
        if not 1 <= min_partial_size <= group_size:
            raise ValueError("min_partial_size must be between 1 and group_size")
        self.group_size = group_size
        self.key = key
        self.groups_per_batch = groups_per_batch
        self.partial_policy = partial_policy
        self.timeout_s = float(timeout_s) if timeout_s is not None else None
        self.min_partial_size = min_partial_size
        self.slot = slot
        self._groups: list[Group] = []  # waiting groups (open and ready), oldest first
        self._open: dict[str, Group] = {}  # the group currently filling, per key
        self._reserved: list[Group] = []  # the groups of the reserved batch
        self._next_order = 0

    # -- keys ---------------------------------------------------------------------------------------------------------

    def group_key_of(self, report: Record, unit: Unit) -> str | None:
        """The group key of a report's sample, or ``None`` when it has none."""
        if self.key == "prompt":
            first = unit.sample.segments[0]
            prompt = unit.sample.messages[first.context_start:first.message_index]
            digest = hashlib.sha256("\x00".join(message_key(m) for m in prompt).encode("utf-8")).hexdigest()
            return f"prompt:{digest[:24]}"
        metadata = report.payload.get("metadata")
        if self.key == "task":
            value = _lookup(metadata, "task")
            if value is None:
                value = _lookup(metadata, "harbor.task_name")
        else:
            value = _lookup(metadata, self.key[len("metadata."):])
        if value is None or isinstance(value, (dict, list)) and not value:
            return None
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))

    # -- units and groups ---------------------------------------------------------------------------------------------

    def _admit(self, unit: Unit, report: Record) -> None:
        key = self.group_key_of(report, unit)
        if key is None:
            self._count_drop(NO_GROUP_KEY)
            return
        slot = None
        if self.slot is not None:
            value = _lookup(report.payload.get("metadata"), self.slot[len("metadata."):])
            slot = None if value is None else json.dumps(value, sort_keys=True)
        group = self._open.get(key)
        if group is not None and slot is not None and slot in group.slots:
            self._count_drop(el.DUPLICATE)
            return
        if group is None:
            group = Group(key=key, order=self._next_order, started_at=unit.arrived_at)
            self._next_order += 1
            self._groups.append(group)
            self._open[key] = group
        unit.sample = replace(unit.sample, group_key=key)
        group.units.append(unit)
        if slot is not None:
            group.slots.add(slot)
        self._claim(unit)
        if len(group.units) >= self.group_size:
            group.ready = True
            del self._open[key]

    def _discard(self, group: Group, reasons: dict[int, str], default: str) -> None:
        for unit in group.units:
            self._drop_unit(unit, reasons.get(id(unit), default))
        self._groups.remove(group)
        if self._open.get(group.key) is group:
            del self._open[group.key]

    def _refresh(self) -> None:
        if self.partial_policy == "wait":
            return
        now = self._clock()
        for group in list(self._groups):
            if group.ready or now - group.started_at < self.timeout_s:
                continue
            if self.partial_policy == "release_partial" and len(group.units) >= self.min_partial_size:
                group.ready = group.partial = True
                if self._open.get(group.key) is group:
                    del self._open[group.key]
            else:
                self._discard(group, {}, GROUP_TIMEOUT)

    def _waiting_units(self) -> Iterable[Unit]:
        return [unit for group in self._groups for unit in group.units]

    def recheck_after(self) -> float | None:
        """When the oldest incomplete group times out (never under the ``wait`` policy)."""
        if self.partial_policy == "wait":
            return None
        with self._lock:
            started = [group.started_at for group in self._groups if not group.ready]
            if not started:
                return None
            return max(0.0, min(started) + self.timeout_s - self._clock())

    def _evict_inadmissible(self, verdicts: dict[int, str]) -> None:
        for group in list(self._groups):
            if any(id(unit) in verdicts for unit in group.units):
                self._discard(group, verdicts, GROUP_DISCARDED)

    def _ready_groups(self) -> list[Group]:
        return [g for g in self._groups if g.ready]

    def _can_select(self) -> bool:
        return len(self._ready_groups()) >= self.groups_per_batch

    def _select(self) -> list[Unit] | None:
        ready = self._ready_groups()
        if len(ready) < self.groups_per_batch:
            return None
        taken = ready[:self.groups_per_batch]
        units: list[Unit] = []
        for group in taken:
            self._groups.remove(group)
            for unit in group.units:
                reef = {**unit.sample.metadata.get("reef", {}), "group_size": len(group.units),
                        "partial": group.partial}
                unit.sample = replace(unit.sample, metadata={**unit.sample.metadata, "reef": reef})
                units.append(unit)
        self._reserved = taken
        return units

    def _put_back(self, units: list[Unit]) -> None:
        self._groups.extend(self._reserved)
        self._groups.sort(key=lambda g: g.order)
        self._reserved = []

    def _batch_done(self) -> None:
        self._reserved = []

    def _status_extra(self) -> dict:
        ready = self._ready_groups()
        return {**super()._status_extra(), "group_size": self.group_size, "key": self.key,
                "groups_per_batch": self.groups_per_batch, "partial_policy": self.partial_policy,
                "timeout_s": self.timeout_s, "open_groups": len(self._groups) - len(ready),
                "ready_groups": len(ready)}
