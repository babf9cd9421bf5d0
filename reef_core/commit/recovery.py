"""Reconcile a scenario's release chain with its commit log after a crash.

Write order of every publication (:class:`reef_core.commit.committer.Committer`):

1. **stage** the release commit (``refs/reef/staged/<sha>``: stored and safe from GC, but not
   served; its manifest carries the commit-log row about to be written);
2. **append** the commit-log row naming the release (fsynced: the commit point);
3. **CAS the head** from the release's parent to the release (or, for a review-held release,
   move it to ``refs/reef/releases/<sha>``).

What :func:`reconcile` does with each crash gap (the log is the truth about *what was
decided*; the head is the truth about *what was served*):

* crash between 1 and 2: a staged release no row names. Not committed, never served: it is
  **discarded** (its records stay unconsumed and will be trained on again).
* crash between 2 and 3: the last head-bearing row names release R, the head is still R's
  parent. The decision is committed: **finish the head move** (CAS parent -> R). A pending row
  whose release is still staged is **finished into the review hold**.
* head ahead of the log (a head move with no row, e.g. a release published through the store
  API directly): it may already have been served, so it is **adopted**, never undone: for each
  release between the last logged one and the head, append the row embedded in its manifest
  (``commit``) if it has one, else a ``recovery`` row with no consumed ids.
* anything else (the head is neither the logged release, its parent, nor a descendant) means
  the chain was moved outside Reef: StorageUnavailable, for an operator to resolve.

Run it with the scenario's log open as a writer, in the one process holding the data directory's
:class:`~reef_core.commit.commitlog.WriterLock` (with a PostgreSQL record store: the process holding the scenario's
learner lease, :mod:`reef_core.loop.lease`, whose log is :class:`~reef_core.commit.pg_log.PgCommitLog`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reef_core.commit.commitlog import CommitLog
from reef_core.commit.store import ArtifactStore
from reef_core.errors import NotFound, StorageUnavailable, ValidationFailed


@dataclass
class RecoveryResult:
    scenario: str
    head: str | None
    step: int
    consumed_ids: set[str]
    actions: list[str] = field(default_factory=list)


def _head_row(log: CommitLog) -> dict | None:
    """The last row that moved (or should have moved) the head."""
    for row in reversed(log.rows(0, limit=max(log.last_step(), 1))):
        if row.get("release_id") and not row.get("pending"):
            return row
    return None


def _chain_between(store: ArtifactStore, head: str, stop: str | None) -> list | None:
    """Releases after ``stop`` up to ``head`` (oldest first), or None if ``stop`` is not an ancestor."""
    path = []
    rid: str | None = head
    while rid is not None and rid != stop:
        rel = store.get(rid)
        path.append(rel)
        rid = rel.parent_release_id
    if rid != stop:
        return None
    return list(reversed(path))


def reconcile(store: ArtifactStore, log: CommitLog, scenario: str) -> RecoveryResult:
    """Bring the head, the review holds and the log back in agreement; see the module doc."""
    if not log.writer:
        raise ValidationFailed("reconcile needs the commit log opened as its writer")
    actions: list[str] = []
    head_rel = store.head(scenario)
    head = head_rel.release_id if head_rel else None
    row = _head_row(log)
    logged = row["release_id"] if row else None

    if logged != head:
        try:
            logged_rel = store.get(logged) if logged else None
        except NotFound:
            logged_rel = None
        if logged_rel is not None and logged_rel.state == "staged" and logged_rel.parent_release_id == head:
            head = store.advance(scenario, logged, expected_head=head).release_id
            actions.append(f"advanced head to {logged} (step {row['step']})")
        elif head is not None and (between := _chain_between(store, head, logged)) is not None:
            for rel in between:
                embedded = dict(rel.log_row or {})
                embedded.pop("step", None)  # re-stepped: the log may have moved on since
                embedded.update(release_id=rel.release_id, pending=False)
                if not rel.log_row:
                    embedded.update(operation="recovery", consumed_ids=[], note="head moved without a log row")
                stored = log.append(embedded, log.last_step())
                actions.append(f"adopted head release {rel.release_id} as step {stored['step']}")
        else:
            raise StorageUnavailable(
                f"scenario {scenario!r}: head {head or 'unset'} and commit log (release {logged or 'none'}, "
                f"step {row['step'] if row else 0}) diverged; resolve manually",
                scenario=scenario,
                head=head,
                logged=logged,
            )

    # Staged leftovers: finish committed review holds, discard the uncommitted.
    logged_rows = {r["release_id"]: r for r in log.rows(0, limit=max(log.last_step(), 1)) if r.get("release_id")}
    for rel in store.staged(scenario):
        committed = logged_rows.get(rel.release_id)
        if committed is not None and committed.get("pending"):
            store.hold(rel.release_id)
            actions.append(f"held {rel.release_id} for review (step {committed['step']})")
        else:
            store.discard(rel.release_id)
            why = "never committed" if committed is None else f"step {committed['step']} was superseded"
            actions.append(f"discarded staged release {rel.release_id} ({why})")

    return RecoveryResult(
        scenario=scenario,
        head=head,
        step=log.last_step(),
        consumed_ids=log.consumed_ids(),
        actions=actions,
    )
