"""The archive of states and PUCT parent selection (TTT-Discover, upstream ``PUCTSampler``).

An :class:`Archive` holds states (a construction, a program: any JSON value) with their verified value ``R``, the
best child value ever seen from them ``m``, their visit count ``n`` and their parent. Each step expands ``G``
parents chosen by PUCT::

    score(i) = Q(i) + c · scale · P(i) · sqrt(1 + T) / (1 + n_i)
    Q(i)     = m_i once i has a child value, else R(i)
    P(i)     = (N − rank_i) / Σ_j (N − rank_j)          rank 0 = highest value, over all N states
    scale    = max(max R − min R over non-seed states, 1e-6)   (all states while there are none)
    T        = expansions so far

States are sorted by ``(score, value)`` descending (ties by id, so a plan is a pure function of the archive) and
picked greedily; each pick blocks its lineage (itself, its ancestors, its descendants), so the groups diverge.
When fewer than ``G`` lineages are free the picks repeat in order.

After a step (:meth:`Archive.update`), per expanded parent: ``m = max(m, best valid child)``, one visit for the
parent and each ancestor and ``T += 1``; every failed rollout (no state, or a state the verifier refuses) adds one
more visit to the parent and its ancestors and ``T += 1``. The best 2 valid children per parent enter the archive,
deduplicated by state; then the archive is cut to ``cap`` states by value (seeds always stay). ``best`` is the best
state ever seen; it only rises.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable


def state_key(state: Any) -> str:
    """The identity of a state for deduplication (canonical JSON)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


@dataclass
class Entry:
    """One state of the archive."""

    id: str
    state: Any
    value: float
    parent: str | None = None
    seed: bool = False
    visits: int = 0
    best_child: float | None = None
    step: int = -1

    def q(self) -> float:
        return self.best_child if self.best_child is not None else self.value


@dataclass
class Child:
    """One rollout of a step: its group's parent, the state it produced (None: failed) and its verified value."""

    parent: str
    state: Any
    value: float | None
    rollout: int = 0
    group: int = 0

    @property
    def valid(self) -> bool:
        return self.state is not None and self.value is not None and math.isfinite(self.value)


@dataclass
class Archive:
    entries: dict[str, Entry] = field(default_factory=dict)
    expansions: int = 0
    #: best value after each update (one per trained step)
    history: list[float] = field(default_factory=list)
    best: dict | None = None
    puct_c: float = 1.0
    children_per_parent: int = 2
    cap: int = 1000

    # -- building -----------------------------------------------------------------------------------------------

    @classmethod
    def seeded(cls, states: Iterable[tuple[Any, float]], **knobs) -> "Archive":
        archive = cls(**knobs)
        for i, (state, value) in enumerate(states):
            entry = Entry(id=f"seed-{i}", state=state, value=float(value), seed=True)
            archive.entries[entry.id] = entry
            archive._note_best(entry)
        if not archive.entries:
            raise ValueError("an archive needs at least one seed state")
        return archive

    def _note_best(self, entry: Entry) -> None:
        if self.best is None or entry.value > self.best["score"]:
            self.best = {"score": entry.value, "state": entry.state, "step": entry.step, "id": entry.id}

    # -- lineage ------------------------------------------------------------------------------------------------

    def ancestors(self, entry_id: str) -> list[str]:
        out, seen = [], set()
        parent = self.entries[entry_id].parent if entry_id in self.entries else None
        while parent is not None and parent in self.entries and parent not in seen:
            out.append(parent)
            seen.add(parent)
            parent = self.entries[parent].parent
        return out

    def lineage(self, entry_id: str) -> set[str]:
        """The entry, its ancestors and its descendants (those still in the archive)."""
        family = {entry_id, *self.ancestors(entry_id)}
        for other in self.entries:
            if entry_id in self.ancestors(other):
                family.add(other)
        return family

    # -- PUCT ---------------------------------------------------------------------------------------------------

    def scores(self) -> dict[str, float]:
        """The PUCT score of every entry."""
        entries = list(self.entries.values())
        n = len(entries)
        ranked = sorted(entries, key=lambda e: (-e.value, e.id))
        rank = {e.id: i for i, e in enumerate(ranked)}
        total = sum(n - r for r in rank.values())
        grown = [e.value for e in entries if not e.seed] or [e.value for e in entries]
        scale = max(max(grown) - min(grown), 1e-6)
        explore = self.puct_c * scale * math.sqrt(1 + self.expansions)
        return {e.id: e.q() + explore * ((n - rank[e.id]) / total) / (1 + e.visits) for e in entries}

    def select(self, groups: int) -> list[str]:
        """The ids of the ``groups`` parents of the next step (see the module docstring)."""
        scores = self.scores()
        order = sorted(self.entries.values(), key=lambda e: (-scores[e.id], -e.value, e.id))
        picked: list[str] = []
        blocked: set[str] = set()
        for entry in order:
            if entry.id in blocked:
                continue
            picked.append(entry.id)
            blocked |= self.lineage(entry.id)
            if len(picked) == groups:
                break
        return [picked[i % len(picked)] for i in range(groups)]

    # -- updates ------------------------------------------------------------------------------------------------

    def _visit(self, entry_id: str) -> None:
        for eid in (entry_id, *self.ancestors(entry_id)):
            self.entries[eid].visits += 1

    def update(self, step: int, children: list[Child]) -> dict[str, float]:
        """Fold one step's rollouts in (see the module docstring); returns counters for metrics."""
        by_parent: dict[str, list[Child]] = {}
        for child in children:
            by_parent.setdefault(child.parent, []).append(child)
        added = failed = duplicates = 0
        known = {state_key(e.state) for e in self.entries.values()}
        for parent_id, kids in by_parent.items():
            if parent_id not in self.entries:
                continue  # cut from the archive since the plan: nothing to credit
            parent = self.entries[parent_id]
            valid = [c for c in kids if c.valid]
            for _ in range(len(kids) - len(valid)):  # failed rollouts: a visit each
                self._visit(parent_id)
                self.expansions += 1
                failed += 1
            if not valid:
                continue
            top = max(c.value for c in valid)
            parent.best_child = top if parent.best_child is None else max(parent.best_child, top)
            self._visit(parent_id)
            self.expansions += 1
            kept = 0
            for child in sorted(valid, key=lambda c: (-c.value, c.group, c.rollout)):
                if kept == self.children_per_parent:
                    break
                key = state_key(child.state)
                if key in known:
                    duplicates += 1
                    continue
                known.add(key)
                entry = Entry(id=f"s{step}-g{child.group}-r{child.rollout}", state=child.state,
                              value=float(child.value), parent=parent_id, step=step)
                self.entries[entry.id] = entry
                self._note_best(entry)
                kept += 1
                added += 1
        self._cut()
        self.history.append(self.best["score"] if self.best else float("nan"))
        return {"added": float(added), "failed": float(failed), "duplicates": float(duplicates)}

    def _cut(self) -> None:
        if len(self.entries) <= self.cap:
            return
        seeds = [e for e in self.entries.values() if e.seed]
        rest = sorted((e for e in self.entries.values() if not e.seed), key=lambda e: (-e.value, e.id))
        keep = seeds + rest[:max(0, self.cap - len(seeds))]
        self.entries = {e.id: e for e in keep}

    # -- reads and persistence ----------------------------------------------------------------------------------

    def summary(self) -> dict:
        """``{"best": {score, state, step}, "size", "history"}`` (the archive route's body)."""
        best = None
        if self.best is not None:
            best = {"score": self.best["score"], "state": self.best["state"], "step": self.best["step"]}
        return {"best": best, "size": len(self.entries), "history": list(self.history),
                "expansions": self.expansions}

    def to_json(self) -> dict:
        return {"entries": [asdict(e) for e in self.entries.values()], "expansions": self.expansions,
                "history": self.history, "best": self.best, "puct_c": self.puct_c,
                "children_per_parent": self.children_per_parent, "cap": self.cap}

    @classmethod
    def from_json(cls, data: dict) -> "Archive":
        archive = cls(expansions=int(data.get("expansions", 0)), history=[float(x) for x in data.get("history", [])],
                      best=data.get("best"), puct_c=float(data.get("puct_c", 1.0)),
                      children_per_parent=int(data.get("children_per_parent", 2)), cap=int(data.get("cap", 1000)))
        for row in data.get("entries", []):
            entry = Entry(**row)
            archive.entries[entry.id] = entry
        return archive
