"""Retention for the release store: what garbage collection may remove, and removing it.

What "removing a release" means here. A release chain is a commit chain and stays auditable:
**no commit, ref or manifest is ever deleted or rewritten**. Every release keeps its row, its
manifest (content id, digests, metrics, evaluation) and its small non-LFS files. What GC
removes is the **LFS weight objects** referenced only by releases outside the retained set.
Such a release is then marked ``refs/reef/pruned/<sha>`` and reports ``restorable: false``:
it can still be listed and audited, but no longer rolled back to or read.

Retained (never pruned):

* every current head, and every staged (in-flight) release;
* the newest ``keep_last`` rows of each scenario's release list (chain plus held releases);
* with ``keep_ever_current`` (default), every release that was ever a scenario head: the whole
  first-parent chain, since heads only move along it. With the default policy GC therefore
  only frees held (review) releases that were never promoted and fell out of ``keep_last``;
  set ``keep_ever_current=False`` to also free old served weights;
* ``pinned`` release ids;
* every release an alias points at (``staging``, custom names: :mod:`reef_core.commit.aliases`), since a request
  may pin it, evaluate it or move ``production`` to it;
* everything reachable from archived scenarios (archiving promises that nothing is destroyed).

An LFS object is deleted only when no retained release references it (content shared with a
retained release, e.g. after a rollback, survives). Orphaned objects that no release references
(stage attempts that lost a race or crashed before their commit) are deleted too. Publishing
holds a shared lock on the repository and :func:`run_gc` an exclusive one, and ``run_gc``
recomputes the retained set under that lock, so an object a concurrent publish just wrote or
re-referenced is never removed. Only a local repository can be collected: LFS servers offer no
delete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from reef_core.commit.store import ArtifactStore
from reef_core.commit.release import Release
from reef_core.errors import ConfigError, ValidationFailed


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 20
    keep_ever_current: bool = True
    pinned: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        if self.keep_last < 1:
            raise ValidationFailed("keep_last must be at least 1 (the current head is always kept)")
        object.__setattr__(self, "pinned", frozenset(self.pinned))


@dataclass
class GcPlan:
    policy: RetentionPolicy
    prune_releases: list[str]  # releases that lose their LFS weights (become non-restorable)
    delete_objects: list[str]  # LFS oids to delete
    orphan_objects: list[str]  # part of delete_objects referenced by no release at all
    retained: list[str]
    reclaimed_bytes: int
    reasons: dict[str, str] = field(default_factory=dict)  # retained release -> why

    def to_dict(self) -> dict:
        return {
            "prune_releases": self.prune_releases,
            "delete_objects": self.delete_objects,
            "orphan_objects": self.orphan_objects,
            "retained": self.retained,
            "reclaimed_bytes": self.reclaimed_bytes,
        }


@dataclass
class GcResult:
    dry_run: bool
    pruned_releases: list[str]
    deleted_objects: list[str]
    reclaimed_bytes: int


def _aliased(store: ArtifactStore, releases: list[Release]) -> dict[str, str]:
    """Release id -> the first alias (by name) pointing at it, over every scenario's alias log (none for a store
    that keeps no aliases)."""
    make = getattr(store, "aliases", None)
    if make is None:
        return {}
    log = make()
    found: dict[str, str] = {}
    for scenario in sorted({rel.scenario for rel in releases}):
        for name, release_id in sorted(log.current(scenario).items()):
            found.setdefault(release_id, name)
    return found


def _retained(releases: list[Release], policy: RetentionPolicy, aliased: dict[str, str]) -> dict[str, str]:
    keep: dict[str, str] = {}
    by_scenario: dict[str, list[Release]] = {}
    for rel in releases:
        if rel.current:
            keep.setdefault(rel.release_id, "current")
        if rel.state in ("staged", "archived"):
            keep.setdefault(rel.release_id, rel.state)
        if policy.keep_ever_current and rel.state == "chain":
            keep.setdefault(rel.release_id, "ever current")
        if rel.release_id in policy.pinned:
            keep.setdefault(rel.release_id, "pinned")
        if rel.release_id in aliased:
            keep.setdefault(rel.release_id, f"alias {aliased[rel.release_id]}")
        if rel.state in ("chain", "held", "promoted"):
            by_scenario.setdefault(rel.scenario, []).append(rel)
    for rows in by_scenario.values():
        # Newest first, as GitArtifactStore.releases lists them (chain order, then time).
        rows.sort(key=lambda r: r.created_at, reverse=True)
        for rel in rows[: policy.keep_last]:
            keep.setdefault(rel.release_id, "keep_last")
    return keep


def _plan(store: ArtifactStore, policy: RetentionPolicy) -> tuple[GcPlan, dict[str, set[str]]]:
    releases = store.all_releases()
    oids = {rel.release_id: rel.lfs_oids() for rel in releases}
    keep = _retained(releases, policy, _aliased(store, releases))
    kept_oids = {oid for rid in keep for oid in oids.get(rid, ())}
    referenced = {oid for refs in oids.values() for oid in refs}
    on_disk = store.lfs_objects()
    delete = sorted(oid for oid in on_disk if oid not in kept_oids)
    doomed = set(delete)
    prune = [
        rel.release_id
        for rel in releases
        if rel.release_id not in keep and rel.restorable and oids[rel.release_id] & doomed
    ]
    plan = GcPlan(
        policy=policy,
        prune_releases=prune,
        delete_objects=delete,
        orphan_objects=sorted(oid for oid in delete if oid not in referenced),
        retained=sorted(keep),
        reclaimed_bytes=sum(on_disk[o].stat().st_size for o in delete),
        reasons=keep,
    )
    return plan, oids


def plan_gc(store: ArtifactStore, policy: RetentionPolicy | None = None) -> GcPlan:
    """Which releases would lose their weights and which LFS objects would be deleted."""
    if store.is_remote:
        raise ConfigError("garbage collection needs a local release repository (LFS servers cannot delete)")
    return _plan(store, policy or RetentionPolicy())[0]


def run_gc(store: ArtifactStore, plan: GcPlan, dry_run: bool = True,
           advance: Callable[[int], None] | None = None) -> GcResult:
    """Carry out ``plan`` (``dry_run``: only report). Re-checks retention under the GC lock; ``advance(1)`` is
    called per object looked at (a progress bar's).

    The store-level equivalent of ``git lfs prune`` for a bare repository: objects are removed
    from ``<repo>/lfs/objects`` and the affected releases are marked pruned. Only objects that
    are in ``plan`` *and* still unretained now are deleted.
    """
    if store.is_remote:
        raise ConfigError("garbage collection needs a local release repository (LFS servers cannot delete)")
    if dry_run:
        return GcResult(True, list(plan.prune_releases), list(plan.delete_objects), plan.reclaimed_bytes)
    with store.exclusive_lock():
        fresh, oids = _plan(store, plan.policy)
        doomed = set(plan.delete_objects) & set(fresh.delete_objects)
        prune = [rid for rid in fresh.prune_releases if oids[rid] & doomed]
        # Mark first: a crash after marking but before deleting leaves bytes, never a
        # release that claims to be restorable without them.
        store.mark_pruned(prune)
        reclaimed = 0
        for oid in sorted(doomed):
            path = store.lfs_path(oid)
            try:
                reclaimed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
            if advance is not None:
                advance(1)
    return GcResult(False, prune, sorted(doomed), reclaimed)
