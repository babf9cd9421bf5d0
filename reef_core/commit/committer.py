"""Publish, roll back, promote and record gate decisions in the documented write order.

stage the release -> append the commit-log row (commit point) -> move the head (or hold).
See :mod:`reef_core.commit.recovery` for what a crash between the steps leaves and how it is
repaired. The committer is the only writer of its scenario's head and of its commit-log rows:
rollbacks, promotions, rejections and live (in-memory, not yet checkpointed) versions go
through it too, so every head move and every step has exactly one writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from reef_core.commit.commitlog import CommitLog
from reef_core.commit.crashpoints import crash_point
from reef_core.commit.store import ArtifactStore, FileValue
from reef_core.commit.recovery import RecoveryResult, reconcile
from reef_core.commit.release import Release


class Committer:
    """Ties one scenario's release chain to its commit log (opened as the writer)."""

    def __init__(self, store: ArtifactStore, log: CommitLog, scenario: str):
        self.store = store
        self.log = log
        self.scenario = scenario

    def recover(self) -> RecoveryResult:
        """Run at start-up, before any other call: see :func:`reconcile`."""
        return reconcile(self.store, self.log, self.scenario)

    def _row(self, operation: str, consumed_ids, algorithm_state, metrics, evaluation, decision, **extra) -> dict:
        return {
            "operation": operation,
            "consumed_ids": list(consumed_ids or ()),
            "algorithm_state": algorithm_state,
            "metrics": metrics or {},
            "evaluation": evaluation,
            "decision": decision,
            **extra,
        }

    def _commit(self, staged: Release, row: dict, step: int, *, hold: bool) -> tuple[Release, dict]:
        row = {**row, "release_id": staged.release_id}
        crash_point("after_stage")
        try:
            stored = self.log.append(row, step)
        except BaseException:
            self.store.discard(staged.release_id)
            raise
        crash_point("after_log")
        if hold:
            return self.store.hold(staged.release_id), stored
        moved = self.store.advance(self.scenario, staged.release_id, expected_head=staged.parent_release_id)
        crash_point("after_head")
        return moved, stored

    def publish(
        self,
        files: Mapping[str, FileValue],
        *,
        expected_head: str | None,
        consumed_ids: Iterable[str] = (),
        operation: str = "training",
        algorithm_state=None,
        metrics: dict | None = None,
        evaluation: dict | None = None,
        decision: dict | None = None,
        source: dict | None = None,
        hold: bool = False,
    ) -> tuple[Release, dict]:
        """Publish a selected candidate; return the release and its commit-log row."""
        step = self.log.last_step()
        row = self._row(operation, consumed_ids, algorithm_state, metrics, evaluation, decision, pending=hold)
        staged = self.store.stage(
            self.scenario,
            files,
            expected_parent=expected_head,
            operation=operation,
            source=source,
            metrics=metrics,
            evaluation=evaluation,
            log_row={**row, "step": step + 1},
        )
        return self._commit(staged, row, step, hold=hold)

    def _republish(self, operation: str, release_id: str, expected_head: str | None,
                   note: dict | None = None) -> tuple[Release, dict]:
        step = self.log.last_step()
        row = self._row(operation, (), None, {}, None, None, pending=False, target_release_id=release_id,
                        **(note or {}))
        staged = self.store.stage_republish(
            self.scenario,
            release_id,
            expected_parent=expected_head,
            operation=operation,
            log_row={**row, "step": step + 1},
            note=note,
        )
        return self._commit(staged, row, step, hold=False)

    def rollback(self, release_id: str, *, expected_head: str | None,
                 note: dict | None = None) -> tuple[Release, dict]:
        """``note``: who asked and why (``by``, ``reason``, ``alias``), kept in the release's source and its row."""
        return self._republish("rollback", release_id, expected_head, note)

    def promote(self, release_id: str, *, expected_head: str | None,
                note: dict | None = None) -> tuple[Release, dict]:
        return self._republish("promote", release_id, expected_head, note)

    def restore(self, release_id: str, *, expected_head: str | None, failed_release_id: str,
                error: str) -> tuple[Release, dict]:
        """Put back ``release_id`` (what still serves) after the head ``failed_release_id`` failed to activate.

        A new release with the serving release's content; its manifest source and its commit-log row name
        the failed release and the error, so history records the failure instead of being rewritten."""
        return self._republish("restore", release_id, expected_head,
                               {"failed_release_id": failed_release_id, "error": error})

    def record_failed_live(self, *, failed_release_id: str, serving_release_id: str | None, error: str) -> dict:
        """A live version (between checkpoints) failed to activate: the row says so and names what serves."""
        row = self._row("restore", (), None, {}, None, None, release_id=None, live_release_id=None,
                        target_release_id=serving_release_id, failed_release_id=failed_release_id, error=error,
                        pending=False)
        return self.log.append(row, self.log.last_step())

    def record_rejection(
        self,
        *,
        consumed_ids: Iterable[str] = (),
        algorithm_state=None,
        metrics: dict | None = None,
        evaluation: dict | None = None,
        decision: dict | None = None,
        operation: str = "training",
    ) -> dict:
        """Commit a rejected candidate: its records are consumed, no release is made."""
        row = self._row(operation, consumed_ids, algorithm_state, metrics, evaluation, decision, release_id=None)
        return self.log.append(row, self.log.last_step())

    def record_live(
        self,
        *,
        consumed_ids: Iterable[str] = (),
        algorithm_state=None,
        metrics: dict | None = None,
        evaluation: dict | None = None,
        decision: dict | None = None,
    ) -> dict:
        """Commit a version that serves from memory without a durable artifact (between checkpoints).

        The row names it ``live:<scenario>:<step>`` (``live_release_id``); its records are consumed and
        the step counter moves, but the head does not: a restart restores the last durable release."""
        step = self.log.last_step()
        row = self._row("training", consumed_ids, algorithm_state, metrics, evaluation, decision, release_id=None,
                        live_release_id=f"live:{self.scenario}:{step + 1}", pending=False)
        return self.log.append(row, step)
