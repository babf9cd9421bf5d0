"""The learner: one per scenario, beside serving, run in turns on a shared worker pool.

A learner holds no thread and no open file while idle. Storing a record wakes it
(``Deployment.record_stored`` -> :meth:`ScenarioLearner.wake`), which asks the
:class:`~reef_core.loop.pool.LearnerPool` for a turn. A turn tails the scenario's new records
from the store (in sequence order) into the recipe's processor and, when a batch is ready,
does one step: the trainer makes a candidate, the evaluation gate decides, and on *select* the
committer commits the release (artifact store + commit log), the surface activates it and the
batch is acknowledged. On *reject* nothing that serves changes: the batch is acknowledged and
the committer records the rejection. A learner with more ready work asks for another turn at
the back of the queue; a failed turn is retried after :data:`RETRY_AFTER_S`; a processor whose
readiness changes with time says when (:meth:`Processor.recheck_after`). Record acceptance
never waits for training.

The learner reaches the deployment only through its ports (:mod:`reef_core.loop.ports`).

Checkpoint cadence (``trainer.checkpoint_every_n_versions``): every N-th accepted version is
written to the artifact store; versions in between are *live*: activated in memory and
committed to the commit log (step, consumed ids, metrics) without a durable artifact. A restart
restores the last durable release; the step counter and consumed ids survive through the log.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..commit.commitlog import CommitLog
from ..commit.canary import COLLECTING, PROMOTE, decide
from ..commit.committer import Committer
from ..commit.crashpoints import crash_point
from ..commit.gate import Candidate, Decision, EvaluationResult, run_gate
from ..commit.release import Release
from ..errors import ActivationFailed, ConfigError, Conflict, NotFound, ReefError, ValidationFailed
from ..grow.trainer import CandidateUpdate, TrainContext, Trainer, TrainerSetup
from ..observe.instructions import pending_entry
from ..observe.processor import Batch, DropCounter, drop_reason
from . import rollout as rollouts
from .ports import LearnerPorts, LearnerSettings
from .taskfile import load_tasks
from ..surfaces.composite import changed_kinds

log = logging.getLogger("reef.learner")

#: Attempts at training one batch before it is dropped as ``trainer_failed``.
MAX_BATCH_FAILURES = 3
#: Seconds before a turn that failed runs again (a batch that keeps failing is dropped after
#: :data:`MAX_BATCH_FAILURES`).
RETRY_AFTER_S = 1.0


class ScenarioLearner:
    def __init__(self, scenario: str, recipe, surface, ports: LearnerPorts, settings: LearnerSettings):
        """``recipe`` is the scenario's ``recipe`` section; ``surface`` the component it names (or None)."""
        self.ports = ports
        self.settings = settings
        self.artifacts = ports.serving.artifacts
        self.name = scenario
        self.recipe = recipe
        self.lock = threading.RLock()  # one writer of this scenario's head: steps, rollback, promote
        self.log = (ports.commit_log(scenario) if ports.commit_log is not None
                    else CommitLog.for_scenario(settings.commits_dir, scenario))
        self.committer = Committer(self.artifacts, self.log, scenario)
        self.surface = surface
        self.processor = None
        if self.recipe.processor:
            self.processor = ports.create(
                "processor", self.recipe.processor, scenario=scenario,
                options=dict(self.recipe.processor_options),
                serving_version=self.serving_version,
                load_records=functools.partial(ports.records.get_many, scenario),
                create=ports.create, engine=ports.serving.engine, run_async=ports.serving.run_async)
        self._trainer: Trainer | None = None
        self._trainer_lock = threading.Lock()
        #: Why this scenario does not train (records are still stored and observed), or None.
        self.training_disabled: str | None = None
        if self.recipe.trainer and self.surface is not None and "weights" in changed_kinds(self.surface):
            # One engine, one base: one full-weight scenario, or any number of LoRA scenarios (own adapters).
            try:
                self.surface.claim(scenario, lora=bool(settings.trainer.lora))
            except Conflict as exc:
                self.training_disabled = exc.message
                log.warning("scenario %s will not train: %s", scenario, exc.message)
        # A weights trainer holds a model copy and optimizer state: build it when a batch first needs it.
        elif self.recipe.trainer:
            self._build_trainer()
        #: ``evaluation.tasks``, loaded once (None: the gate runs the trainer's own eval tasks).
        self.eval_tasks = (load_tasks(settings.evaluation.tasks, key="evaluation.tasks")
                           if getattr(settings.evaluation, "tasks", None) else None)
        self.checkpoint_every = settings.checkpoint_every
        self.publish_mode = settings.evaluation.publish
        #: ``evaluation.rollout``; with ``canary``, a selected release serves a share of traffic first.
        self.rollout = settings.evaluation.rollout
        #: The canary running now (read by serving for each request), its tally, and the last decision (status).
        self.canary: rollouts.Canary | None = None
        self.canary_tally: rollouts.CanaryTally | None = None
        self.head: Release | None = None
        self.live_release_id: str | None = None
        self.versions_since_checkpoint = 0
        self.last_sequence = 0
        self.counters = {"steps": 0, "selected": 0, "rejected": 0, "skipped": 0, "stale_batches": 0, "errors": 0,
                         "activation_failures": 0}
        self.last_error: str | None = None
        #: What the learner itself dropped without training (an instruction whose step failed); the processor
        #: counts its own samples (see :meth:`dropped`).
        self.drops = DropCounter(scenario)
        #: The last committed release that failed to activate and what was restored (status), or None.
        self.activation_error: dict | None = None
        self.last_metrics: dict = {}
        self.release_metrics: dict[str, dict] = self._load_release_metrics()
        self._pending_latency: dict[str, float] = {}
        self._batch_failures: dict[str, int] = {}
        self._stopped = False
        #: Pending instructions (``train`` records not consumed by a commit), oldest first.
        self.instructions: dict[str, Any] = {}
        self._consumed_at_start: set[str] = set()
        self._running = False  # a turn runs now (status only; the pool keeps one turn per scenario)

    # -- start-up and recovery -------------------------------------------------------------------

    def start(self) -> None:
        recovered = self.committer.recover()
        if recovered.actions:
            log.warning("scenario %s recovered: %s", self.name, "; ".join(recovered.actions))
        self.head = self.artifacts.head(self.name)
        consumed = set(recovered.consumed_ids) | self.ports.records.consumed_ids(self.name)
        self._consumed_at_start = consumed  # instructions a commit already consumed are not pending
        if self.processor is not None:
            self.processor.restore(consumed)
        if self.head is None:
            self._create()
        self._recover_canary()
        if self.head is not None and self.surface is not None and self.training_disabled is None:
            # A scenario that may not move the engine's weights serves what the owner serves: nothing to restore.
            self._serve_head_at_start()
            self._remember(self.head.release_id, {"serving_version": self.serving_version()})
        if self.processor is not None and getattr(self.processor, "replay_at_start", False):
            # Its door depends on what the stream holds (a sequential grid's open step): catch up before serving.
            self._ingest()
        self.ports.pool.register(self.name, self._turn)
        if self.processor is not None:
            self.wake()  # catch up on records stored before this start (a restart, a replayed stream)

    def _create(self) -> None:
        """Publish release 0 of a new scenario, so its chain is never empty and a rollback can reach the start.

        The trainer's seed files (a harness recipe), else what the surface says a start is (``base.json``
        naming the base model, for weights). A scenario without either (no surface: nothing it serves comes
        from the chain) gets none."""
        files, source = {}, {"kind": "seed"}
        if self._trainer is not None:
            files = self._trainer.initial_files()
            if files and hasattr(self.surface, "carry"):  # a composite: the other parts start from their creation
                files = self.surface.carry(files, lambda: {})
        if not files and self.surface is not None:
            files, source = self.surface.creation_files(), {"kind": "base"}
        if files:
            self.head, _ = self.committer.publish(files, expected_head=None, operation="creation", source=source)

    def _build_trainer(self) -> Trainer:
        if self._trainer is not None:
            return self._trainer
        with self._trainer_lock:  # a route handler (ScenarioView.trainer) may ask while a turn does
            if self._trainer is not None:
                return self._trainer
            serving = self.ports.serving
            setup = TrainerSetup(data_dir=self.settings.data_dir, engine=serving.engine,
                                 load_base_model=self._load_start_model,
                                 load_reference_model=serving.load_base_model, seed=self.settings.seed,
                                 run_async=serving.run_async, device=_device_of(serving.engine),
                                 evaluation=self.settings.evaluation, batch_size=_batch_size(self.recipe))
            self._trainer = self.ports.create("trainer", self.recipe.trainer, scenario=self.name,
                                              recipe=self.recipe, trainer=self.settings.trainer, context=setup)
        return self._trainer

    @property
    def trainer(self) -> Trainer | None:
        return self._build_trainer() if self.recipe.trainer else None

    @property
    def has_trainer(self) -> bool:
        return bool(self.recipe.trainer) and self.training_disabled is None

    def stop(self, timeout: float = 30) -> None:
        """No more turns; waits for a running one to finish its step."""
        self._stopped = True
        self.ports.pool.unregister(self.name)
        self.ports.pool.wait_idle(self.name, timeout)
        if self._trainer is not None:
            try:
                self._trainer.close()  # e.g. Ray workers: they outlive nothing that stopped
            except Exception:  # noqa: BLE001 - stopping goes on
                log.warning("scenario %s: closing the trainer failed", self.name, exc_info=True)

    def wake(self) -> None:
        """Ask for a turn (records arrived); returns at once."""
        if not self._stopped:
            self.ports.pool.schedule(self.name)

    def _files(self, release_id: str):
        return lambda: self.artifacts.read_files(release_id)

    def _trainer_files(self, release_id: str):
        """A release's files as the trainer sees them (of a composite, its changed part's, unprefixed)."""
        view = getattr(self.surface, "trainer_view", None)
        if view is None:
            return self._files(release_id)
        return lambda: view(self.artifacts.read_files(release_id))

    def _load_start_model(self):
        """The model a weights trainer starts from: the scenario's head checkpoint, else the base."""
        from ..surfaces.weights import base_reference, state_dict_from_files

        load_base_model = self.ports.serving.load_base_model
        model, tokenizer = load_base_model()
        if self.head is not None:
            files = self._trainer_files(self.head.release_id)()
            if base_reference(files) is None:  # a creation release is the base itself
                model.load_state_dict(state_dict_from_files(files, load_base_model), strict=False)
        return model, tokenizer

    # -- the loop ------------------------------------------------------------------------------------

    def serving_version(self) -> str | None:
        if self.surface is not None:
            return self.surface.serving_version(self.name)
        return None

    def _turn(self) -> None:
        """One turn on a pool worker: ingest new records and train at most one ready batch."""
        if self._stopped:
            return
        self._running = True
        try:
            self._ingest()
            self._canary_turn()
            # One canary at a time: ready batches wait for its decision, then train against the head it leaves.
            if self._trains() and self.canary is None and self._has_work():
                if self._instruction_due():
                    self._instruction_step()
                else:
                    self._step()
                self._ingest()
                if not self._stopped and self._has_work():
                    self.ports.pool.schedule(self.name)  # more to do: again, behind the scenarios waiting
                    return
            later = self.processor.recheck_after() if self.processor is not None else None
            if later is not None:
                self.ports.pool.schedule_later(self.name, later)
        except Exception as exc:  # noqa: BLE001 - the learner must survive a bad step
            self.counters["errors"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("scenario %s: learner step failed", self.name, exc_info=True)
            self.ports.pool.schedule_later(self.name, RETRY_AFTER_S)
        finally:
            self._running = False

    def _instruction_due(self) -> bool:
        return self.recipe.training_mode != "auto" and bool(self.instructions)

    def _has_work(self) -> bool:
        """An instruction waits (manual, hybrid), or a batch of traffic is ready (auto, hybrid: ``manual`` trains on
        traffic only together with an instruction)."""
        return self._instruction_due() or (self.recipe.training_mode != "manual" and self.processor.ready())

    def _instruction_step(self) -> None:
        """One step on the oldest pending instruction (batch ``<scenario>:instruction:<id>``), with the units of the
        traffic batch that is ready, if any. The instruction is consumed whatever the step's outcome: a failed
        instruction step is committed as skipped with its error, never retried."""
        record = next(iter(self.instructions.values()))
        traffic = self.processor.pending_batch() if self.processor.ready() else None
        batch = Batch(batch_id=f"{self.name}:instruction:{record.record_id}",
                      samples=list(traffic.samples) if traffic else [],
                      record_ids=[record.record_id, *(traffic.record_ids if traffic else [])], scenario=self.name,
                      instructions=[{"agent_record_id": record.record_id, **record.payload}])
        self._step(batch, _InstructionSettle(self, record.record_id, traffic.batch_id if traffic else None))

    def _trains(self) -> bool:
        return self.processor is not None and self.has_trainer and not self._stopped

    def _ingest(self) -> None:
        if self.processor is None:
            return
        for record in self.ports.records.replay(self.name, self.last_sequence):
            if record.kind == "train":  # a person's instruction: kept for the trainer, never a processor's input
                if record.record_id not in self._consumed_at_start:
                    self.instructions[record.record_id] = record
            else:
                self.processor.ingest(record)
            if self.canary_tally is not None:
                self.canary_tally.observe(record)
            self.last_sequence = max(self.last_sequence, record.sequence or 0)

    def _step(self, batch=None, settle=None) -> None:
        """:meth:`_train_step`, then ``reef_step_committed`` for each training row it committed (every outcome commits
        one: selected, rejected, held, refused), after the lock is released, so a slow listener never holds it."""
        since = self.log.last_step()
        try:
            self._train_step(batch, settle)
        finally:
            self._announce_steps(since)

    def _announce_steps(self, since: int) -> None:
        """``reef_step_committed`` for the training rows after step ``since``; a failed read only costs the notices."""
        try:
            for step in range(since + 1, self.log.last_step() + 1):  # one read a row (the PostgreSQL log's too)
                row = self.log.row(step)
                if row.get("operation") == "training":
                    self.ports.notify("reef_step_committed", scenario=self.name, row=row)
        except Exception:  # noqa: BLE001 - the step is committed whatever its listeners hear
            log.warning("scenario %s: steps after %d not announced", self.name, since, exc_info=True)

    def _train_step(self, batch=None, settle=None) -> None:
        """Train one batch (the processor's pending one unless given); ``settle`` acknowledges or drops it (the
        processor, unless an instruction step settles its own way)."""
        retry = settle is None
        settle = settle or self.processor
        batch = batch or self.processor.pending_batch()
        if batch is None:
            return
        with self.lock:
            step = self.log.last_step() + 1
            ctx = TrainContext(scenario=self.name, step=step,
                               serving_release_id=self.current_release_id(),
                               serving_version=self.serving_version(),
                               algorithm_state=(self.log.last_row() or {}).get("algorithm_state"),
                               current_files=self._trainer_files(self.head.release_id) if self.head else (lambda: {}))
        started = time.perf_counter()
        try:
            update = self.trainer.train(batch, ctx)
        except ReefError as exc:
            # A batch the trainer refuses (e.g. missing log-probs) is dropped with its reason, once.
            consumed = settle.drop(batch.batch_id, f"trainer_refused: {exc.message}")
            self._commit_rejection(consumed, {"train_error": exc.message}, None, None)
            self.counters["skipped"] += 1
            # Its records are consumed without training: an error of the step, not a quiet outcome.
            self.counters["errors"] += 1
            self.last_error = f"step {step} skipped: {exc.message}"
            log.warning("scenario %s: step %s skipped, the trainer refused batch %s: %s", self.name, step,
                        batch.batch_id, exc.message)
            return
        except Exception as exc:
            # An unexpected failure is retried on the next wake; a batch that keeps failing is dropped
            # (and its records consumed) so one poisoned batch cannot stall the scenario for good.
            failures = self._batch_failures.get(batch.batch_id, 0) + 1
            self._batch_failures = {batch.batch_id: failures}
            if retry and failures < MAX_BATCH_FAILURES:
                raise
            consumed = settle.drop(batch.batch_id, "trainer_failed")
            self._commit_rejection(consumed, {"train_error": f"{type(exc).__name__}: {exc}"}, None, None)
            self.counters["skipped"] += 1
            raise
        train_s = time.perf_counter() - started
        if update is not None and hasattr(self.surface, "carry") and self.head is not None:
            # A composite: the parts the trainer does not change carry the head's content forward.
            update = dataclasses.replace(update, files=self.surface.carry(update.files, self._files(self.head.release_id)))
        if update is None:
            consumed = settle.drop(batch.batch_id, "trainer_skipped")
            self._commit_rejection(consumed, {"skipped": True}, None, None)
            self.counters["skipped"] += 1
            return
        metrics = {**update.metrics, "train_s": round(train_s, 4), "batch_size": len(batch.samples)}
        candidate = Candidate(candidate_id=f"{self.name}:{step}", scenario=self.name,
                              base_release_id=ctx.serving_release_id, files=None, payload=update.payload,
                              metadata={"step": step})
        decision = self._gate(candidate, update)
        self.counters["steps"] += 1
        self.last_metrics = metrics
        if decision.selected:
            self._accept(batch, update, metrics, decision, settle)
        else:
            self.trainer.rejected(update)
            consumed = settle.acknowledge(batch.batch_id)
            self._commit_rejection(consumed, metrics, decision.evaluation, decision)
            self.counters["rejected"] += 1
            log.info("scenario %s: candidate %s rejected: %s", self.name, candidate.candidate_id, decision.reason)

    def _gate(self, candidate: Candidate, update: CandidateUpdate) -> Decision:
        cfg = self.settings.evaluation
        create = self.ports.create
        options = cfg.options
        policy_options = options.get("policy", {}) if isinstance(options.get("policy"), dict) else {}
        evaluator_options = options.get("evaluator", {}) if isinstance(options.get("evaluator"), dict) else {}
        empty = EvaluationResult(evaluator="none", version="0", metrics={}, scores=[])
        if self.surface is not None:
            try:  # a release its surface could not serve is never published
                self.surface.validate(update.files)
                if self.head is not None:
                    self.surface.validate_successor(update.files, self._files(self.head.release_id))
            except ValidationFailed as exc:
                return Decision(decision="reject", policy=cfg.policy, evaluation=empty, metrics={},
                                reason=f"the {self.surface.kind} surface refused the candidate: {exc.message}")
        try:
            # Registered names, or an explicit "package.module:Name" (PluginManager.create loads those).
            policy = create("selection_policy", cfg.policy, **policy_options)
            if not hasattr(policy, "decide"):
                raise ConfigError(f"selection policy {cfg.policy!r} has no decide(candidate, evaluation) method")
            if cfg.evaluator:
                evaluator = create("evaluator", cfg.evaluator, tasks=self._evaluation_tasks(update),
                                   run=self.trainer.run_task, options=evaluator_options)
            else:
                evaluator = _NoEvaluation()
        except Exception as exc:  # noqa: BLE001 - a broken gate rejects (fail closed)
            return Decision(decision="reject", policy=cfg.policy, reason=f"gate setup failed: {exc}",
                            evaluation=empty, metrics={})
        return run_gate(evaluator, policy, candidate)

    def _evaluation_tasks(self, update: CandidateUpdate) -> list:
        """What the evaluator runs: the processor's held-out records for ``replay``, else the
        ``evaluation.tasks`` file when set, else the trainer's own ``eval_tasks``."""
        if self.settings.evaluation.evaluator == "replay":
            replay_tasks = getattr(self.processor, "replay_tasks", None)
            return replay_tasks() if replay_tasks is not None else []
        return list(self.eval_tasks) if self.eval_tasks is not None else update.eval_tasks

    def _accept(self, batch, update: CandidateUpdate, metrics: dict, decision: Decision, settle=None) -> None:
        settle = settle or self.processor
        accepted_at = time.perf_counter()
        with self.lock:
            consumed = list(batch.record_ids)
            canary = self.rollout.strategy == "canary"
            hold = self.publish_mode == "review" or canary
            source = update.source or {"kind": "training"}
            if canary:  # held out of the chain, served to a share of traffic until decided
                source = {**source, "rollout": rollouts.canary_source(self.rollout)}
            durable = hold or self.surface is None or self.surface.kind != "weights" or (
                (self.versions_since_checkpoint + 1) % self.checkpoint_every == 0)
            evaluation = decision.evaluation.to_dict() if decision.evaluation else None
            before = (self.head, self.live_release_id)  # what serves until the new version is activated
            if durable:
                release, _row = self.committer.publish(
                    update.files, expected_head=self.head.release_id if self.head else None,
                    consumed_ids=consumed, algorithm_state=update.algorithm_state, metrics=metrics,
                    evaluation=evaluation, decision=decision.to_dict(), source=source, hold=hold)
                if hold:
                    settle.acknowledge(batch.batch_id)
                    self.ports.records.mark_consumed(self.name, consumed, _row["step"])
                    self.trainer.rejected(update)  # the policy keeps serving what it served
                    self.counters["selected"] += 1
                    if canary:
                        self._start_canary(release)
                    return
                self.head = release
                release_id = release.release_id
                self.live_release_id = None
                step = _row["step"]
            else:
                row = self.committer.record_live(consumed_ids=consumed, algorithm_state=update.algorithm_state,
                                                 metrics=metrics, evaluation=evaluation, decision=decision.to_dict())
                release_id = row["live_release_id"]
                self.live_release_id = release_id
                step = row["step"]
            commit_ms = round((time.perf_counter() - accepted_at) * 1000, 3)  # the durable part of publishing
            served = self._activate_committed(release_id, before, payload=update.payload, durable=durable)
            if served:
                self.versions_since_checkpoint = 0 if durable else self.versions_since_checkpoint + 1
                version = self.serving_version()
                # Publish latency: selected -> the engine serves the new version (the next request runs on it).
                publish_ms = round((time.perf_counter() - accepted_at) * 1000, 3)
                self._pending_latency[version or release_id] = accepted_at
                self._remember(release_id, {"serving_version": version, "step": step,
                                            "publish_latency_ms": publish_ms, "commit_ms": commit_ms})
                self.trainer.accepted(update, release_id)
            else:
                self.trainer.rejected(update)  # the trainer resyncs to the version that still serves
            settle.acknowledge(batch.batch_id)
            crash_point("before_mark_consumed")
            self.ports.records.mark_consumed(self.name, consumed, step)
            self.counters["selected"] += 1
        if durable and self.head is not before[0]:
            self.ports.notify("reef_release_published", scenario=self.name, release=self.head)
        log.info("scenario %s: step %d published %s (serving %s)", self.name, step, release_id,
                 self.serving_version())

    # -- activation ----------------------------------------------------------------------------------

    def _serve_head_at_start(self) -> None:
        """Activate the head at start-up. A head that does not activate (a crash came between its commit and its
        restore) is answered as at any time: the head returns to its parent. With nothing left to serve this
        raises (the deployment quarantines the scenario instead of serving a version it does not have)."""
        parent = None
        # A restore that does not activate either is not answered by another one (a restart would chain them).
        if self.head.parent_release_id and self.head.operation != "restore":
            try:
                parent = self.artifacts.get(self.head.parent_release_id)
            except NotFound:
                parent = None
        if self._activate_committed(self.head.release_id, (parent, None)):
            return
        failure = self.activation_error
        if not failure.get("restored_activated"):
            raise ActivationFailed(f"scenario {self.name!r}: head {failure['release_id']} failed to activate "
                                   f"({failure['error']}) and no earlier release could be restored")

    def _activate_committed(self, release_id: str, before: tuple[Release | None, str | None], *,
                            payload=None, durable: bool = True) -> bool:
        """Serve a release that is already committed; True when it serves.

        ``before`` is (head, live release id) as they were before the commit: what still serves. A surface
        whose activation raises leaves what served in place (the contract of :meth:`Surface.activate`),
        so the head goes back to it through a ``restore`` release (history is only appended), the failure
        is recorded, and status shows it. Called with :attr:`lock` held."""
        if self.surface is None:
            return True
        try:
            self.surface.activate(self.name, release_id, payload=payload,
                                  files=self._files(release_id) if durable else None)
            return True
        except Exception as exc:  # noqa: BLE001 - any activation failure must leave an honest head
            error = f"{type(exc).__name__}: {exc}"[:2000]
            log.error("scenario %s: release %s failed to activate", self.name, release_id, exc_info=True)
        before_head, before_live = before
        restored_id = None
        restored_activated = False  # not re-activated when a live version still serves from memory
        if not durable:
            # A live version is only a log row: say it never served; the head did not move.
            self.committer.record_failed_live(failed_release_id=release_id, error=error,
                                              serving_release_id=before_live or (
                                                  before_head.release_id if before_head else None))
            self.live_release_id = before_live
        elif before_head is not None:
            restored, _row = self.committer.restore(before_head.release_id, expected_head=release_id,
                                                    failed_release_id=release_id, error=error)
            self.head = restored
            self.live_release_id = before_live  # a live version still serves from memory until restart
            restored_id = restored.release_id
            if before_live is None:
                # Same content as what serves; activated so the surface names the release the head names.
                try:
                    self.surface.activate(self.name, restored_id, files=self._files(restored_id))
                    restored_activated = True
                except Exception as again:  # noqa: BLE001
                    error += f"; re-activating the restored release failed too: {type(again).__name__}: {again}"
                    log.error("scenario %s: restored release %s failed to activate: %s", self.name, restored_id, again)
            self._remember(restored_id, {"serving_version": self.serving_version()})
        self.activation_error = {"release_id": release_id, "error": error, "restored_release_id": restored_id,
                                 "restored_activated": restored_activated,
                                 "serving_release_id": self.current_release_id(),
                                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.last_error = f"activation of {release_id} failed: {error}"
        self.counters["activation_failures"] += 1
        return False

    def _commit_rejection(self, consumed, metrics, evaluation, decision) -> None:
        with self.lock:
            row = self.committer.record_rejection(
                consumed_ids=consumed, metrics=metrics,
                evaluation=evaluation.to_dict() if hasattr(evaluation, "to_dict") else evaluation,
                decision=decision.to_dict() if hasattr(decision, "to_dict") else decision)
            self.ports.records.mark_consumed(self.name, list(consumed), row["step"])

    # -- publish latency -------------------------------------------------------------------------

    def served(self, version: str | None) -> None:
        """Called for each stored inference: the first one served by a new version ends its publish latency."""
        if version is None or version not in self._pending_latency:
            return
        started = self._pending_latency.pop(version, None)
        if started is None:
            return
        latency_ms = (time.perf_counter() - started) * 1000
        release_id = next((rid for rid, m in self.release_metrics.items() if m.get("serving_version") == version),
                          self.current_release_id() or version)
        # First response: selected -> the first stored record produced by the new version (includes its generation).
        self._remember(release_id, {"first_response_ms": round(latency_ms, 3)})

    def _remember(self, release_id: str, metrics: dict) -> None:
        """Metrics known only after publication (serving version, publish latency), kept beside the chain.

        ``serving_version`` is the version serving the release now; ``serving_versions`` every version that
        ever served it (a restart serves the head under a new incarnation), so each record's version maps
        to a release."""
        known = self.release_metrics.get(release_id, {})
        version = metrics.get("serving_version")
        if version is not None:
            earlier = list(known.get("serving_versions", []))
            metrics = {**metrics, "serving_versions": earlier + [version] if version not in earlier else earlier}
        self.release_metrics[release_id] = {**known, **metrics}
        self._save_release_metrics()

    def _release_metrics_path(self) -> Path:
        return self.settings.release_metrics_dir / f"{self.log.path.stem}.json"

    def _load_release_metrics(self) -> dict:
        try:
            return json.loads(self._release_metrics_path().read_text())
        except (OSError, ValueError):
            return {}

    def _save_release_metrics(self) -> None:
        path = self._release_metrics_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.release_metrics))
        os.replace(tmp, path)

    # -- the canary (loop/rollout.py, commit/canary.py) -------------------------------------------------------

    def _recover_canary(self) -> None:
        """The canary no release has decided on yet, from the chain (a restart mid-canary finds it; its tally is
        rebuilt as the records are replayed)."""
        found = rollouts.running_canary(self.artifacts.releases(self.name), self.current_release_id())
        if found is None:
            return
        if self.rollout.strategy != "canary":
            log.warning("scenario %s: canary %s is undecided but evaluation.rollout.strategy is %s: it stays held "
                        "(promote it, or set the strategy back to canary)", self.name, found.release_id,
                        self.rollout.strategy)
            return
        self.canary, self.canary_tally = found, rollouts.CanaryTally(found.release_id)

    def _start_canary(self, release: Release) -> None:
        self.canary = rollouts.Canary(release.release_id, self.rollout.share, self.rollout.sticky,
                                      release.created_at, self.current_release_id())
        self.canary_tally = rollouts.CanaryTally(release.release_id)
        log.info("scenario %s: release %s is the canary (share %g)", self.name, release.release_id,
                 self.rollout.share)

    def canary_test(self) -> dict | None:
        """The rule's answer on the running canary's scores so far, or None without a canary."""
        tally = self.canary_tally
        if self.canary is None or tally is None:
            return None
        r = self.rollout
        return decide(tally.sides[rollouts.CANARY], tally.sides[rollouts.PRODUCTION], alpha=r.alpha,
                      min_scored=r.min_scored, max_scored=r.max_scored)

    def _canary_turn(self) -> None:
        """Apply the rule when a score arrived for the running canary; a decision is published at once."""
        tally = self.canary_tally
        if self.canary is None or tally is None or not tally.changed:
            return
        tally.changed = False
        evidence = self.canary_test()
        if evidence is not None and evidence["decision"] != COLLECTING:
            self.conclude_canary(evidence["decision"], by="rule", reason=evidence["why"], evidence=evidence)

    def conclude_canary(self, action: str, *, by: str, reason: str, evidence: dict | None = None) -> Release:
        """Promote the canary (it becomes the head through the promote path) or roll it back (the head republished:
        a release recording the withdrawal); either release keeps the decision and its evidence in
        ``source.canary`` and its commit-log row. Conflict when no canary runs."""
        with self.lock:
            canary = self.canary
            if canary is None:
                raise Conflict(f"scenario {self.name!r} has no canary running")
            evidence = evidence or self.canary_test()
            note = {"by": by, "reason": reason,
                    "canary": {"release_id": canary.release_id, "decision": action, "evidence": evidence}}
            log.info("scenario %s: canary %s %s by %s: %s", self.name, canary.release_id,
                     "promoted" if action == PROMOTE else "rolled back", by, reason)
            if action == PROMOTE:
                return self.republish("promote", canary.release_id, note)
            return self.republish("rollback", self.head.release_id, note)

    def _canary_decided(self, operation: str, release_id: str, note: dict | None) -> None:
        """A republish decided the running canary (its decision release, or a plain promote of it): it stops
        serving, and the batches that waited for it train."""
        canary = self.canary
        decision = (note or {}).get("canary") or {}
        if canary is None or not (decision.get("release_id") == canary.release_id
                                  or (operation == "promote" and release_id == canary.release_id)):
            return
        self.canary, self.canary_tally = None, None
        self.wake()

    def canary_state(self) -> dict:
        """The running canary, its scores by arm and the rule's current answer (``GET .../canary``)."""
        canary = self.canary
        return {"canary": canary.row() if canary is not None else None,
                "production_release_id": self.current_release_id(), "test": self.canary_test()}

    # -- operations and reads ----------------------------------------------------------------------

    def current_release_id(self) -> str | None:
        return self.live_release_id or (self.head.release_id if self.head else None)

    def republish(self, operation: str, release_id: str, note: dict | None = None) -> Release:
        """Rollback or promote: publish an earlier (or held) release's content as a new head (``note``: who asked
        and why, kept in the new release's source)."""
        with self.lock:
            try:
                target = self.artifacts.get(release_id)
            except NotFound:
                raise NotFound(f"unknown release {release_id!r} in scenario {self.name!r}") from None
            if target.scenario != self.name:
                raise NotFound(f"release {release_id!r} does not belong to scenario {self.name!r}")
            if operation == "promote" and not target.pending:
                raise Conflict(f"release {release_id!r} is not pending review")
            before = (self.head, self.live_release_id)
            expected = self.head.release_id if self.head else None
            release, _row = (self.committer.rollback if operation == "rollback" else self.committer.promote)(
                release_id, expected_head=expected, note=note)
            self._canary_decided(operation, release_id, note)
            self.head = release
            self.live_release_id = None
            served = self._activate_committed(release.release_id, before)
            if served:
                self.versions_since_checkpoint = 0
                if self.surface is not None:
                    self._remember(release.release_id, {"serving_version": self.serving_version()})
            if self._trainer is not None:
                self._trainer.rejected(CandidateUpdate(files={}))  # trainers resync to what now serves
            head = self.head
        self.ports.notify("reef_release_published", scenario=self.name, release=head)
        if not served:
            failure = self.activation_error
            raise ActivationFailed(
                f"{operation} committed release {release.release_id}, which failed to activate "
                f"({failure['error']}); release {failure['serving_release_id']} still serves",
                failed_release_id=release.release_id, restored_release_id=failure["restored_release_id"])
        return release

    def release_rows(self) -> list[dict]:
        rows = []
        current = self.current_release_id()
        if self.live_release_id:
            last = self.log.last_row() or {}
            rows.append({"release_id": self.live_release_id, "parent_release_id": self.head.release_id
                         if self.head else None, "content_id": None, "operation": "training",
                         "metrics": {**last.get("metrics", {}), **self.release_metrics.get(self.live_release_id, {})},
                         "current": True, "pending": False, "restorable": False, "checkpoint": False,
                         "content_kind": "live_weights"})
        for release in self.artifacts.releases(self.name):
            row = release.to_dict()
            row["metrics"] = {**(row.get("metrics") or {}), **self.release_metrics.get(release.release_id, {})}
            row["current"] = release.release_id == current
            rows.append(row)
        return rows

    def view(self):
        """This scenario as a recipe's route handler sees it (:class:`~reef_core.loop.ports.ScenarioView`)."""
        from .ports import ScenarioView

        return ScenarioView(name=self.name, recipe=self.recipe, processor=self.processor,
                            serving_version=self.serving_version, trainer=lambda: self.trainer,
                            current_release_id=self.current_release_id, release_files=self.artifacts.read_files)

    def commit_rows(self, after_step: int, limit: int, record_ids) -> list[dict]:
        return self.log.rows(after_step, limit, record_ids)

    def state(self) -> str:
        """``running`` (a turn runs now), ``scheduled`` (waiting for a worker), ``idle`` or ``stopped``."""
        if self._stopped:
            return "stopped"
        if self._running:
            return "running"
        return "scheduled" if self.ports.pool.busy(self.name) else "idle"

    def dropped(self) -> dict[str, int]:
        """Every sample or record of this scenario dropped without training, by reason: the processor's (judge
        failures, staleness, expiry, records gone, batches the trainer refused) and the learner's own."""
        counts = dict(self.processor.dropped()) if self.processor is not None else {}
        for reason, n in self.drops.counts().items():
            counts[reason] = counts.get(reason, 0) + n
        return dict(sorted(counts.items()))

    def status(self) -> dict:
        return {
            "scenario": self.name,
            "recipe": self.recipe.name,
            "learner": self.state(),
            "step": self.log.last_step(),
            "current_release_id": self.current_release_id(),
            "current_version": self.serving_version(),
            "versions_since_checkpoint": self.versions_since_checkpoint,
            "records_seen": self.last_sequence,
            "processor": self.processor.status() if self.processor is not None else None,
            "dropped": self.dropped(),
            "instructions": {"training_mode": self.recipe.training_mode,
                             "pending": [pending_entry(r) for r in list(self.instructions.values())]},
            "trainer": self.recipe.trainer,
            # The recipe's own gate (a routed recipe's evaluation section, not the top level's).
            "gate": {"policy": self.settings.evaluation.policy, "evaluator": self.settings.evaluation.evaluator,
                     "publish": self.publish_mode, "rollout": self.rollout.strategy},
            "canary": self.canary.release_id if self.canary is not None else None,
            "counters": dict(self.counters),
            "last_metrics": self.last_metrics,
            "last_error": self.last_error,
            "training_disabled": self.training_disabled,
            "activation_error": self.activation_error or _activation_error_of(self.head),
            "last_publish": next((dict(m, release_id=rid) for rid, m in reversed(list(self.release_metrics.items()))
                                  if "publish_latency_ms" in m), None),
        }


class _InstructionSettle:
    """Settles an instruction step in place of the processor: the instruction is consumed either way; the traffic
    batch it took along is acknowledged with it when the step counts (committed, selected or not), and released (its
    units train later) when the step is dropped."""

    def __init__(self, learner: ScenarioLearner, record_id: str, traffic_batch_id: str | None):
        self.learner, self.record_id, self.traffic = learner, record_id, traffic_batch_id

    def acknowledge(self, _batch_id: str) -> list[str]:
        consumed = [self.record_id]
        if self.traffic is not None:
            consumed += self.learner.processor.acknowledge(self.traffic)
        self.learner.instructions.pop(self.record_id, None)
        return consumed

    def drop(self, _batch_id: str, reason: str) -> list[str]:
        if self.traffic is not None:
            self.learner.processor.release(self.traffic)
        self.learner.instructions.pop(self.record_id, None)
        label, detail = drop_reason(reason)
        self.learner.drops.drop(f"instruction_{label}" + (f": {detail}" if detail else ""))
        log.warning("scenario %s: instruction %s not trained (%s)", self.learner.name, self.record_id, reason)
        return [self.record_id]


def _activation_error_of(head: Release | None) -> dict | None:
    """A head that is a ``restore`` release names the failed activation it answered (status after a restart)."""
    if head is None or head.operation != "restore":
        return None
    source = head.source or {}
    return {"release_id": source.get("failed_release_id"), "error": source.get("error"),
            "restored_release_id": head.release_id, "serving_release_id": head.release_id, "at": head.created_at}


class _NoEvaluation:
    """Evaluation when no evaluator is configured: no scores (policies like ``always`` decide alone)."""

    def evaluate(self, candidate):
        return EvaluationResult(evaluator="none", version="1", metrics={}, scores=[])


def _device_of(engine) -> str | None:
    """The device of the local engine (a trainer with ``trainer.device`` unset follows it); None for others."""
    device = getattr(engine, "device", None)
    return str(device) if device is not None else None


def _batch_size(recipe) -> int | None:
    """The recipe's batch size from its processor options (``batch_size``, else the grouped or grid product); None
    when the processor decides alone."""
    opts = getattr(recipe, "processor_options", None) or {}

    def number(key: str) -> int | None:
        value = opts.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    if number("batch_size") is not None:
        return number("batch_size")
    for a, b in (("group_size", "groups_per_batch"), ("groups", "rollouts_per_group")):
        if number(a) is not None and number(b) is not None:
            return number(a) * number(b)
    return None
