"""The ``ttt`` trainer: the archive and the policy step of one scenario, committed together.

:class:`TTTTrainer` wraps a :class:`~reef_core.api.TorchTrainer` running :class:`~reef_ttt.objective.TTTObjective`
(LoRA by default) and owns the scenario's :class:`~reef_ttt.archive.Archive`. One batch is one complete step of the
sequential grid barrier (``G x R`` reports, constant groups kept). A step:

1. takes the committed archive of the serving release and the parents PUCT picks from it (the same plan
   ``GET .../ttt/plan`` served, since a plan is a pure function of the archive);
2. re-scores every reported ``metadata.state`` with the task's verifier (a claim is never trusted; a refused or
   missing state is a failed rollout: a visit, no entry) and, in guidance mode, sets the reward of a malformed
   guide reply to 0 whatever the client reported;
3. folds the rollouts into a copy of the archive (visits, best child, top children, cap);
4. leaves constant groups out of the gradient (the first is kept when all are, so the step still trains) and runs
   one optimizer step on the rest;
5. adds the new archive to the candidate's files (``algorithm/ttt_archive.json``) and a summary to its algorithm
   state. The archive becomes the committed one only when the candidate is accepted (:meth:`accepted`); a rejected
   candidate leaves it as it was. A restart or rollback reloads the archive of the serving release (seeds for the
   creation release), so archive and adapter always resume as a pair.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable, Iterator

from reef_core.api import (
    CandidateUpdate,
    ConfigError,
    RecipeConfig,
    TorchTrainer,
    Trainer,
    TrainerConfig,
    TrainerSetup,
)

from reef_ttt.archive import Archive, Child
from reef_ttt.options import TTTOptions, check_processor_options
from reef_ttt.task import load_task, parse_guidance

ARCHIVE_FILE = "algorithm/ttt_archive.json"


class WithFile(Mapping):
    """A release's files plus one more entry (the big ones stay lazy)."""

    def __init__(self, files: Mapping[str, Any], name: str, data: bytes):
        self._files, self._name, self._data = files, name, data

    def __getitem__(self, name: str) -> Any:
        return self._data if name == self._name else self._files[name]

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in self._files if n != self._name)
        yield self._name

    def __len__(self) -> int:
        return len([n for n in self._files if n != self._name]) + 1


class TTTTrainer(Trainer):
    """See the module docstring."""

    artifact_kind = "weights"

    def __init__(self, inner: TorchTrainer, task: Any, opts: TTTOptions):
        self.inner = inner
        self.task = task
        self.opts = opts
        self._lock = threading.Lock()
        self._archive: Archive | None = None
        self._release: str | None = None  # the release whose archive ``_archive`` is
        self._pending: tuple[CandidateUpdate, Archive] | None = None

    # -- the archive -----------------------------------------------------------------------------------------------

    def seeded_archive(self) -> Archive:
        return seeded_archive(self.task, self.opts)

    def archive_of(self, release_id: str | None, files: Callable[[], Mapping[str, Any]]) -> Archive:
        """The committed archive of ``release_id`` (the one in memory when it is that release's, else read from
        its files: the seeds for a release without one). Never changes what this trainer holds."""
        with self._lock:
            if self._archive is not None and self._release == release_id:
                return self._archive
        data = files().get(ARCHIVE_FILE) if release_id is not None else None
        if data is None:
            return self.seeded_archive()
        return Archive.from_json(json.loads(bytes(data).decode()))

    def _sync(self, release_id: str | None, files: Callable[[], Mapping[str, Any]]) -> Archive:
        archive = self.archive_of(release_id, files)
        with self._lock:
            self._archive, self._release = archive, release_id
        return archive

    def plan(self, archive: Archive) -> list[str]:
        """The parents of the next step: the same picks ``GET .../ttt/plan`` served from this archive."""
        return archive.select(self.opts.groups_per_step)

    # -- the step --------------------------------------------------------------------------------------------------

    def _child(self, sample: Any, parents: list[str]) -> tuple[Child, Any, dict]:
        grid = sample.metadata.get("reef", {}).get("grid", {})
        group, rollout, step = int(grid.get("group", 0)), int(grid.get("rollout", 0)), int(grid.get("step", 0))
        state = sample.metadata.get("state")
        notes = {"step": step, "malformed": 0, "mismatch": 0}
        if self.opts.mode == "guidance" and parse_guidance(sample.completion, tags=self.opts.guidance_tags) is None:
            notes["malformed"] = 1
            state = None
            if sample.reward != 0.0:
                sample = replace(sample, reward=0.0)
        value = self.task.score(state) if state is not None else None
        if value is not None and sample.reward is not None and abs(value - float(sample.reward)) > 1e-9:
            notes["mismatch"] = 1
        return Child(parents[group], state, value, rollout=rollout, group=group), sample, notes

    def train(self, batch, ctx) -> CandidateUpdate | None:
        archive = self._sync(ctx.serving_release_id, ctx.current_files)
        parents = self.plan(archive)
        children, samples, malformed, mismatches, step = [], [], 0, 0, 0
        for sample in batch.samples:
            child, sample, notes = self._child(sample, parents)
            children.append(child)
            samples.append(sample)
            malformed += notes["malformed"]
            mismatches += notes["mismatch"]
            step = notes["step"]
        updated = copy.deepcopy(archive)
        counters = updated.update(step, children)
        kept, constant = _gradient_groups(samples)
        update = self.inner.train(replace(batch, samples=kept), ctx)
        if update is None:
            return None
        rewards = [float(s.reward) for s in samples]
        summary = updated.summary()
        update.metrics.update({
            "ttt/step": step, "ttt/archive_best": summary["best"]["score"], "ttt/archive_size": summary["size"],
            "ttt/batch_reward_mean": sum(rewards) / max(len(rewards), 1), "ttt/constant_groups": constant,
            "ttt/children_added": counters["added"], "ttt/failed_rollouts": counters["failed"],
            "ttt/malformed_guidance": malformed, "ttt/score_mismatches": mismatches,
        })
        update.files = WithFile(update.files, ARCHIVE_FILE, json.dumps(updated.to_json()).encode())
        update.algorithm_state = {**(update.algorithm_state or {}),
                                  "ttt": {"step": step, "best": summary["best"]["score"], "size": summary["size"]}}
        self._pending = (update, updated)
        return update

    def accepted(self, update: CandidateUpdate, release_id: str | None) -> None:
        self.inner.accepted(update, release_id)
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is update:
            with self._lock:
                self._archive, self._release = pending[1], release_id

    def rejected(self, update: CandidateUpdate) -> None:
        self.inner.rejected(update)
        self._pending = None

    def run_task(self, subject: Any, task: dict) -> Any:
        return self.inner.run_task(subject, task)

    def initial_files(self) -> Mapping[str, Any]:
        return self.inner.initial_files()

    def close(self) -> None:
        self.inner.close()


def seeded_archive(task: Any, opts: TTTOptions) -> Archive:
    """The archive of a scenario's start: the task's seeds with their verified values."""
    states = []
    for state in task.seeds():
        value = task.score(state)
        if value is None:
            raise ConfigError(f"ttt: a seed of task {opts.task!r} fails its own verifier")
        states.append((state, value))
    return Archive.seeded(states, puct_c=float(opts.puct_c), children_per_parent=opts.children_per_parent,
                          cap=opts.archive_cap)


def _gradient_groups(samples: list) -> tuple[list, int]:
    """The samples of groups whose rewards vary (all of the first group when none do) and the number of constant
    groups left out."""
    groups: dict[Any, list] = {}
    for sample in samples:
        groups.setdefault(sample.group_key, []).append(sample)
    varied = [key for key, rows in groups.items() if len({s.reward for s in rows}) > 1]
    keep = set(varied) if varied else {next(iter(groups))} if groups else set()
    kept = [s for s in samples if s.group_key in keep]
    return kept, len(groups) - len(keep)


def make_ttt_trainer(*, scenario: str, recipe: RecipeConfig, trainer: TrainerConfig, context: TrainerSetup,
                     **_extra) -> TTTTrainer:
    """Build the TTT trainer of one scenario (validated options -> task -> objective -> TorchTrainer)."""
    from reef_ttt.objective import TTTObjective

    opts = TTTOptions.from_options(recipe.options)
    check_processor_options(opts, recipe.processor, recipe.processor_options)
    if trainer.checkpoint_every_n_versions != 1:
        raise ConfigError("ttt: trainer.checkpoint_every_n_versions must be 1: the archive is part of every release, "
                          "so archive and adapter resume as a pair")
    if opts.batch_size % max(trainer.grad_accumulation, 1):
        raise ConfigError(f"ttt: G x R = {opts.batch_size} must be a multiple of trainer.grad_accumulation "
                          f"{trainer.grad_accumulation}")
    task = load_task(opts.task, opts.task_options)
    objective = TTTObjective(advantage=opts.advantage, kl_coef=opts.kl_coef, learn=opts.learn)
    inner = TorchTrainer.from_config(objective, context, trainer, who="ttt", max_grad_norm=opts.max_grad_norm,
                                     weight_decay=float(opts.weight_decay), betas=tuple(opts.betas),
                                     name="ttt-guidance" if opts.mode == "guidance" else "ttt-discover")
    return TTTTrainer(inner, task, opts)
