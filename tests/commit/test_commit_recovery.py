"""Crash gaps between staging, the commit-log append and the head move, and their repair."""

from __future__ import annotations

import pytest

from reef_core.commit import CommitLog, Committer, reconcile
from reef_core.errors import Conflict, StorageUnavailable
from reef_core.testing.chain import publish

S = "agent"


@pytest.fixture
def log(tmp_path):
    with CommitLog.for_scenario(tmp_path / "logs", S) as log:
        yield log


@pytest.fixture
def base(release_store, log):
    """A scenario with one committed, served release (step 1)."""
    committer = Committer(release_store, log, S)
    rel, _ = committer.publish({"p": b"v1"}, expected_head=None, consumed_ids=["r0"], operation="creation")
    return rel


def test_consistent_state_needs_nothing(release_store, log, base):
    result = reconcile(release_store, log, S)
    assert result.actions == []
    assert (result.head, result.step, result.consumed_ids) == (base.release_id, 1, {"r0"})


def test_crash_after_stage_before_log_discards(release_store, log, base):
    staged = release_store.stage(S, {"p": b"v2"}, expected_parent=base.release_id, log_row={"operation": "training"})
    result = reconcile(release_store, log, S)
    assert result.head == base.release_id and result.step == 1
    assert result.actions == [f"discarded staged release {staged.release_id} (never committed)"]
    assert release_store.staged() == []
    assert release_store.head(S).release_id == base.release_id


def test_crash_after_log_before_head_move_finishes_the_move(release_store, log, base):
    staged = release_store.stage(S, {"p": b"v2"}, expected_parent=base.release_id)
    log.append({"operation": "training", "release_id": staged.release_id, "consumed_ids": ["r1", "r2"]}, 1)
    assert release_store.head(S).release_id == base.release_id  # the crash: head not moved
    result = reconcile(release_store, log, S)
    assert result.head == staged.release_id == release_store.head(S).release_id
    assert result.step == 2 and result.consumed_ids == {"r0", "r1", "r2"}
    assert result.actions == [f"advanced head to {staged.release_id} (step 2)"]
    assert release_store.staged() == []
    assert reconcile(release_store, log, S).actions == []  # idempotent


def test_crash_before_review_hold_finishes_the_hold(release_store, log, base):
    staged = release_store.stage(S, {"p": b"cand"}, expected_parent=base.release_id)
    log.append({"operation": "training", "release_id": staged.release_id, "pending": True, "consumed_ids": ["r1"]}, 1)
    result = reconcile(release_store, log, S)
    assert result.head == base.release_id
    assert result.actions == [f"held {staged.release_id} for review (step 2)"]
    assert release_store.get(staged.release_id).pending


def test_head_ahead_of_log_is_adopted_from_the_manifest(release_store, log, base):
    # Head moved with no row: once with the intended row embedded, once with none at all.
    embedded = {"operation": "training", "consumed_ids": ["r5"], "metrics": {"loss": 0.1}, "step": 2}
    r2 = publish(release_store, S, {"p": b"v2"}, expected_parent=base.release_id, log_row=embedded)
    r3 = publish(release_store, S, {"p": b"v3"}, expected_parent=r2.release_id)
    result = reconcile(release_store, log, S)
    assert result.head == r3.release_id and result.step == 3
    rows = log.rows()
    assert rows[1]["release_id"] == r2.release_id and rows[1]["consumed_ids"] == ["r5"]
    assert rows[1]["metrics"] == {"loss": 0.1}
    assert rows[2]["release_id"] == r3.release_id and rows[2]["operation"] == "recovery"
    assert result.consumed_ids == {"r0", "r5"}


def test_diverged_chain_is_reported(release_store, log, base):
    release_store.archive(S)
    publish(release_store, S, {"p": b"unrelated"}, expected_parent=None)
    with pytest.raises(StorageUnavailable, match="diverged"):
        reconcile(release_store, log, S)


def test_committer_write_order_end_to_end(release_store, log, base):
    committer = Committer(release_store, log, S)
    r2, row2 = committer.publish({"p": b"v2"}, expected_head=base.release_id, consumed_ids=["r1"])
    assert row2["release_id"] == r2.release_id and r2.log_row["step"] == 2 and r2.current
    held, row3 = committer.publish({"p": b"v3"}, expected_head=r2.release_id, consumed_ids=["r2"], hold=True)
    assert held.pending and row3["pending"] is True
    promoted, row4 = committer.promote(held.release_id, expected_head=r2.release_id)
    assert promoted.current and row4["operation"] == "promote" and row4["target_release_id"] == held.release_id
    rejected = committer.record_rejection(consumed_ids=["r3"], decision={"decision": "reject"})
    assert rejected["release_id"] is None and rejected["step"] == 5
    back, row6 = committer.rollback(base.release_id, expected_head=promoted.release_id)
    assert back.content_id == base.content_id and row6["step"] == 6
    with pytest.raises(Conflict):  # a stale head: no row appended, nothing staged
        committer.publish({"p": b"x"}, expected_head=base.release_id)
    assert log.last_step() == 6 and release_store.staged() == []
    result = committer.recover()
    assert result.actions == [] and result.head == back.release_id
    assert result.consumed_ids == {"r0", "r1", "r2", "r3"}
