"""``trainer.backend=slime``: each step is a slime training job; its HF checkpoint comes back as the candidate.

Reef keeps serving and recording. For a ready batch the trainer writes a job directory
(:mod:`reef_core.grow.slime.jobs`), moves the job marker to ``RUNNING``, runs ``trainer.slime.launch`` with the
directory appended and waits for the job to reach ``CHECKPOINT``. It then reads the checkpoint (every file checked
against the job's manifest) into a :class:`~reef_core.grow.trainer.CandidateUpdate`, which the learner gates,
commits and activates through the normal path. Each job starts from the serving release's weights and writes only
inside its own directory, so a job that did not finish leaves nothing behind that the next one could read.

Recovery. The commit log is the truth about steps: a step ``N`` is decided once the log holds a row for it
(published or rejected, its records consumed in the same transaction). At every ``train`` call the trainer
looks at its scenario's unfinished jobs; ``ctx.step`` is the step the learner would commit next.

========================  ==================================================================================
phase found               recovery
========================  ==================================================================================
``RUNNING``               ambiguous (the job may have trained or not): the directory is renamed
                          ``*.abandoned`` (a late write of that job then fails) and marked ``ABANDONED``; its
                          output is never read. The batch's records are not consumed, so a new job trains the
                          current batch from the serving release: the step is run again, never continued.
``CHECKPOINT``            the checkpoint is complete: if the job's record ids equal the pending batch's, it is
``UPDATING_WEIGHTS``      adopted without training again (its files re-read and re-checked, which is
``READY_TO_COMMIT``       idempotent); otherwise (another batch is pending) the job is ``ABANDONED``.
                          With ``job step < ctx.step`` the log already decided the step: the job becomes
                          ``HEAD_COMMITTED`` when the serving release holds its checkpoint, else ``REJECTED``;
                          it is never adopted again.
``HEAD_COMMITTED``        the release is the head; only clean-up is left: ``COMPLETE``.
``COMPLETE``, ``REJECTED``, ``ABANDONED``  nothing.
========================  ==================================================================================

Custom-loss families: before writing the job, the objective's ``prepare`` runs here (:mod:`.learner_side`) and its
per-token advantages go into the rollout file with the hook's header; the objective's state after it travels with
the job, so an adopted checkpoint carries the state its step produced.

Nothing of slime is imported here; the job's command line is built by :mod:`reef_core.grow.slime.flags`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from ...commit.crashpoints import crash_point
from ...errors import ConfigError
from ...models.release_files import MODEL_FILE, base_reference
from ..objective import Objective
from ..token_batch import TokenBatch
from ..trainer import CandidateUpdate, TrainContext, Trainer
from . import jobs
from .flags import check_hf_model_type, check_job_flags, family_flags, is_custom, job_argv, slime_loss_of
from .learner_side import LearnerSide, loss_header, state_file, token_advantages
from .marker import (ABANDONED, CHECKPOINT, COMPLETE, FINAL, HEAD_COMMITTED, READY_TO_COMMIT, REJECTED, RUNNING,
                     UPDATING_WEIGHTS, read_marker, write_marker)

log = logging.getLogger("reef.grow.slime")

#: Phases whose checkpoint is complete (verified by its manifest) and may be adopted.
_ADOPTABLE = (CHECKPOINT, UPDATING_WEIGHTS, READY_TO_COMMIT)


class SlimeJobFailed(RuntimeError):
    """The job ended without a checkpoint (the learner retries the batch; the retry abandons this job)."""


class SlimeTrainer(Trainer):
    """One scenario's slime jobs (see the module docstring)."""

    artifact_kind = "weights"

    @classmethod
    def from_config(cls, objective: Objective, context: Any, trainer: Any, *, who: str, **_overrides) -> "SlimeTrainer":
        settings = trainer.slime
        if not settings.launch:
            raise ConfigError(f"{who}: trainer.backend=slime needs trainer.slime.launch (the job command)")
        if trainer.lora:
            raise ConfigError(f"{who}: trainer.backend=slime trains full weights; unset trainer.lora")
        family_flags(objective)  # an objective without a slime loss is refused now, not at the first step
        objective.check_slime()  # what slime's batch cannot carry
        check_job_flags(objective, settings.flags or {}, getattr(context, "batch_size", None))
        data_dir = Path(getattr(context, "data_dir", ".") or ".")
        jobs_dir = Path(settings.jobs_dir) if settings.jobs_dir else data_dir / "slime-jobs"
        model_dir = getattr(getattr(context, "engine", None), "model_dir", None)
        if model_dir:  # slime sets the model up from this HF directory (--load): refused now if it cannot
            check_hf_model_type(Path(model_dir))
        return cls(objective, launch=list(settings.launch), flags=dict(settings.flags), jobs_dir=jobs_dir,
                   timeout_s=float(settings.timeout_s), lr=float(trainer.lr),
                   load_base_model=getattr(context, "load_reference_model", None) or context.load_base_model,
                   base_model_dir=Path(model_dir) if model_dir else None,
                   device=trainer.device if trainer.device is not None else getattr(context, "device", None))

    def __init__(self, objective: Objective, *, launch: list[str], flags: dict, jobs_dir: Path, timeout_s: float,
                 lr: float, load_base_model: Callable[[], tuple[Any, Any]], base_model_dir: Path | None = None,
                 device: str | None = None):
        self.objective = objective
        #: Custom-loss families: the objective's preparation and state, in this process.
        self.learner = LearnerSide(objective, load_base_model, device=device) \
            if is_custom(slime_loss_of(objective)) else None
        self.launch = launch
        self.flags = flags
        self.jobs_dir = Path(jobs_dir).expanduser().absolute()  # a job runs elsewhere: never relative
        self.timeout_s = timeout_s
        self.lr = lr
        self.load_base_model = load_base_model
        #: The served base model's HF directory: the input of a step from the creation release (no copy made).
        self.base_model_dir = base_model_dir if base_model_dir and (base_model_dir / "config.json").exists() else None
        #: Jobs whose driver ran in this process (tests count them: an adopted checkpoint launches nothing).
        self.launched = 0

    # -- the step ----------------------------------------------------------------------------------------------

    def train(self, batch, ctx: TrainContext) -> CandidateUpdate | None:
        root = self._scenario_dir(ctx.scenario)
        record_ids = sorted(batch.record_ids)
        if self.learner is not None:
            self.learner.sync(ctx)
        job_dir = self.recover(root, ctx, record_ids)
        started = time.monotonic()
        if job_dir is None:
            tb = TokenBatch.from_samples(list(batch.samples))
            gbs = self.flags.get("--global-batch-size")
            if gbs is not None and int(gbs) != tb.size:  # (a recipe without a fixed batch size, unchecked at build)
                raise ConfigError(f"trainer.slime.flags: --global-batch-size {gbs} differs from this batch's "
                                  f"{tb.size} samples; Reef trains one optimizer step per batch")
            prepared = self.learner.prepare(tb) if self.learner is not None else None
            if prepared is not None and not prepared.update_policy:
                self.learner.kept()  # the objective's own models trained (a critic warm-up): no candidate
                log.info("slime: the step trained the objective's auxiliary models only; no job")
                return None
            job_dir = self._run_job(root, tb, prepared, ctx, record_ids)
        update = self._candidate(job_dir)
        update.metrics["seconds"] = time.monotonic() - started
        return update

    def _scenario_dir(self, scenario: str) -> Path:
        key = hashlib.sha256(scenario.encode()).hexdigest()[:12]
        return self.jobs_dir / key

    def _run_job(self, root: Path, tb: TokenBatch, prepared, ctx: TrainContext, record_ids: list[str]) -> Path:
        job_id = uuid.uuid4().hex[:12]
        job_dir = root / f"step-{ctx.step:08d}-{job_id}"
        job_dir.mkdir(parents=True)
        hf_in = self._write_input(root, job_dir, ctx)
        rollout: dict[str, Any] = {"rollout_id": 0}
        extra: dict[str, Any] = {}
        if prepared is not None:  # a custom-loss family: the recipe's advantages and the hook's header
            rollout["samples"] = jobs.slime_samples(tb, token_advantages(self.objective, prepared))
            rollout["reef"] = loss_header(self.objective, prepared.batch)
            tensors = self.learner.tensors()
            if tensors is not None:
                (job_dir / jobs.OBJECTIVE_STATE).write_bytes(tensors)
                extra["objective_state_sha256"] = hashlib.sha256(tensors).hexdigest()
            extra["objective_json_state"] = self.objective.json_state()
            extra["prepare_metrics"] = {k: v for k, v in prepared.metrics.items()
                                        if isinstance(v, (int, float, str, bool)) or v is None}
        else:  # slime's built-in loss; the pickled objective is what the fake driver runs in its place
            rollout["samples"] = jobs.slime_samples(tb)
            torch.save(self.objective, job_dir / jobs.OBJECTIVE)
        samples = rollout["samples"]
        torch.save(rollout, job_dir / jobs.ROLLOUT)
        argv = job_argv(slime_loss_of(self.objective), self.flags, lr=self.lr, rollout=str(job_dir / jobs.ROLLOUT),
                        hf_in=str(hf_in), hf_out=str(job_dir / jobs.CHECKPOINT_DIR),
                        save=str(job_dir / jobs.MEGATRON_DIR), samples=len(samples))
        (job_dir / jobs.JOB).write_text(json.dumps({
            "job_id": job_id, "scenario": ctx.scenario, "step": ctx.step, "record_ids": record_ids,
            "objective": self.objective.name, "serving_release_id": ctx.serving_release_id, "slime_args": argv,
            **extra,
        }, indent=1))
        write_marker(job_dir, RUNNING, job_id=job_id, step=ctx.step, record_ids=record_ids)
        self.launched += 1
        self.run_driver(job_dir)
        marker = read_marker(job_dir)
        if marker is None or marker["phase"] != CHECKPOINT:
            raise SlimeJobFailed(f"slime job {job_id} ended in phase {marker and marker['phase']} without a checkpoint")
        return job_dir

    def run_driver(self, job_dir: Path) -> None:
        """Run the job command and wait for it (a job that overruns ``timeout_s`` is stopped)."""
        proc = subprocess.Popen([*self.launch, str(job_dir)])
        try:
            rc = proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SlimeJobFailed(f"slime job {job_dir.name} ran past trainer.slime.timeout_s={self.timeout_s}")
        if rc != 0:
            log.warning("slime job %s exited with status %s", job_dir.name, rc)

    def _write_input(self, root: Path, job_dir: Path, ctx: TrainContext) -> Path:
        """The HF checkpoint of the serving release: the base model's (saved once per scenario) or the release's."""
        files = ctx.current_files() if ctx.serving_release_id else {}
        if files and base_reference(files) is None:
            target = job_dir / jobs.INPUT
            jobs.write_files(target, files)
            return target
        if self.base_model_dir is not None:
            return self.base_model_dir
        base = root / "base"  # no directory to point at: the base is saved once per scenario
        if not base.exists():
            tmp = root / f".base.{uuid.uuid4().hex[:8]}"
            model, tokenizer = self.load_base_model()
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            tmp.rename(base)
        return base

    def _candidate(self, job_dir: Path) -> CandidateUpdate:
        from safetensors.torch import load as load_safetensors

        marker = write_marker(job_dir, UPDATING_WEIGHTS)
        crash_point("slime_updating_weights")
        files = jobs.read_checkpoint(job_dir)
        if MODEL_FILE not in files:
            raise SlimeJobFailed(f"slime job {marker['job_id']}: its checkpoint has no {MODEL_FILE}")
        payload = load_safetensors(files[MODEL_FILE])
        metrics_path = job_dir / jobs.METRICS
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        algorithm_state = None
        if self.learner is not None:
            job = json.loads((job_dir / jobs.JOB).read_text())
            metrics = {**job.get("prepare_metrics", {}), **metrics}
            if job.get("objective_state_sha256"):
                tensors = (job_dir / jobs.OBJECTIVE_STATE).read_bytes()
                if hashlib.sha256(tensors).hexdigest() != job["objective_state_sha256"]:
                    raise SlimeJobFailed(f"slime job {marker['job_id']}: {jobs.OBJECTIVE_STATE} differs from job.json")
                files[state_file(self.objective)] = tensors
                self.learner.load_tensors(tensors)  # an adopted job's state is the one its step produced
            self.objective.load_json_state(job.get("objective_json_state"))
            algorithm_state = {"objective": self.objective.name, "objective_state": job.get("objective_json_state")}
        write_marker(job_dir, READY_TO_COMMIT)
        crash_point("slime_ready_to_commit")
        metrics.update({"slime_job": marker["job_id"], "slime_step": marker["step"]})
        update = CandidateUpdate(files=files, payload=payload, metrics=metrics, algorithm_state=algorithm_state,
                                 source={"kind": "training", "backend": "slime", "job": marker["job_id"]})
        update.slime_job_dir = job_dir  # accepted()/rejected() close the job's marker
        return update

    # -- the learner's answer ----------------------------------------------------------------------------------

    def accepted(self, update: CandidateUpdate, release_id: str | None) -> None:
        if self.learner is not None:
            self.learner.accepted(release_id)
        job_dir = getattr(update, "slime_job_dir", None)
        if job_dir is None:
            return
        write_marker(job_dir, HEAD_COMMITTED, release_id=release_id)
        crash_point("slime_head_committed")
        jobs.cleanup(job_dir)
        write_marker(job_dir, COMPLETE)

    def rejected(self, update: CandidateUpdate) -> None:
        if self.learner is not None:
            self.learner.rejected()
        job_dir = getattr(update, "slime_job_dir", None)
        if job_dir is None:
            return
        jobs.cleanup(job_dir)
        write_marker(job_dir, REJECTED, reason="the gate or the activation refused the candidate")

    # -- recovery ----------------------------------------------------------------------------------------------

    def recover(self, root: Path, ctx: TrainContext, record_ids: list[str]) -> Path | None:
        """Settle every unfinished job of the scenario (see the module docstring); return the job whose complete
        checkpoint belongs to the pending batch, or None (a new job trains it)."""
        adopt = None
        if not root.exists():
            return None
        for job_dir in sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".abandoned")):
            marker = read_marker(job_dir)
            if marker is None:  # the directory was being written when the process died: no job ever ran
                self._abandon(job_dir, "no marker")
                continue
            phase, step = marker["phase"], int(marker["step"])
            if phase in FINAL:
                continue
            if phase == HEAD_COMMITTED:
                jobs.cleanup(job_dir)
                write_marker(job_dir, COMPLETE)
            elif phase == RUNNING or step > ctx.step:
                self._abandon(job_dir, f"found in {phase} at step {ctx.step}")
            elif step < ctx.step:
                self._settle_decided(job_dir, marker, ctx)
            elif phase in _ADOPTABLE and marker.get("record_ids") == record_ids and adopt is None:
                log.info("slime job %s: adopting its checkpoint (found in %s)", marker["job_id"], phase)
                adopt = job_dir
            else:
                self._abandon(job_dir, "its batch is no longer the pending one")
        return adopt

    def _settle_decided(self, job_dir: Path, marker: dict, ctx: TrainContext) -> None:
        """The commit log holds a row for the job's step: record whether its checkpoint became the head."""
        ours = False
        if marker["phase"] == READY_TO_COMMIT and ctx.step == int(marker["step"]) + 1 and ctx.serving_release_id:
            try:
                manifest = json.loads((job_dir / jobs.MANIFEST).read_text())
                served = ctx.current_files().get(MODEL_FILE)
                ours = served is not None and hashlib.sha256(bytes(served)).hexdigest() == manifest.get(MODEL_FILE)
            except (OSError, ValueError):
                ours = False
        jobs.cleanup(job_dir)
        if ours:
            write_marker(job_dir, HEAD_COMMITTED, release_id=ctx.serving_release_id)
            write_marker(job_dir, COMPLETE)
        else:
            write_marker(job_dir, REJECTED, reason=f"step {marker['step']} was decided without this job")

    def _abandon(self, job_dir: Path, reason: str) -> None:
        log.warning("slime job %s abandoned: %s", job_dir.name, reason)
        fenced = job_dir.with_name(job_dir.name + ".abandoned")
        shutil.rmtree(fenced, ignore_errors=True)
        job_dir.rename(fenced)
        if read_marker(fenced) is not None:
            write_marker(fenced, ABANDONED, reason=reason)
        jobs.cleanup(fenced)
