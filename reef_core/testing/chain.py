"""Publish, roll back and promote directly on an artifact store, for tests of the release chain.

In a deployment only the :class:`~reef_core.commit.committer.Committer` publishes (stage, commit-log
row, advance); tests of the store alone, of retention or of a surface need releases without a
commit log, and get them here through the same two steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from reef_core.commit.release import Release
from reef_core.commit.store import ArtifactStore, FileValue


def finish(store: ArtifactStore, staged: Release, *, hold: bool = False) -> Release:
    """Serve a staged release (or hold it for review); a failure discards it."""
    try:
        if hold:
            return store.hold(staged.release_id)
        return store.advance(staged.scenario, staged.release_id, expected_head=staged.parent_release_id)
    except BaseException:
        with contextlib.suppress(Exception):
            store.discard(staged.release_id)
        raise


def publish(store: ArtifactStore, scenario: str, files: Mapping[str, FileValue], *, expected_parent: str | None,
            hold: bool = False, **stage_options) -> Release:
    """Stage ``files`` on ``expected_parent`` and serve them (``hold=True``: keep them pending)."""
    staged = store.stage(scenario, files, expected_parent=expected_parent, **stage_options)
    return finish(store, staged, hold=hold)


def rollback(store: ArtifactStore, scenario: str, release_id: str, *, expected_head: str | None) -> Release:
    """Serve an earlier release's content again, as a new release."""
    return finish(store, store.stage_republish(scenario, release_id, expected_parent=expected_head,
                                               operation="rollback"))


def promote(store: ArtifactStore, scenario: str, release_id: str, *, expected_head: str | None) -> Release:
    """Serve a review-held release, as a new release."""
    return finish(store, store.stage_republish(scenario, release_id, expected_parent=expected_head,
                                               operation="promote"))
