"""The ``gepa`` trainer: one GEPA iteration per batch of reports, on the scenario's harness tree.

One :meth:`GepaTrainer.train` call is one iteration of ``gepa.optimize``'s loop, run with the
library's own pieces on a persistent :class:`~reef_gepa.archive.Archive`:

A batch carrying a person's instruction (``POST /reef/train`` on a ``manual`` / ``hybrid`` scenario) adds its text to
every reflection record's feedback; without reported traffic its minibatch is the valset.

1. (first call, or when the served tree is new to the archive) the served components are
   validated on the valset and enter the archive (the seed, or a parentless candidate);
2. if a merge is due (``use_merge``), gepa's ``MergeProposer`` tries one and the iteration ends;
3. otherwise gepa's ``ReflectiveMutationProposer``: parent from the per-task Pareto front
   (``ParetoCandidateSelector``), minibatch (the batch's reported traffic, or an
   ``EpochShuffledBatchSampler`` draw from ``trainset``), one component per round
   (``RoundRobinReflectionComponentSelector``), reflection with gepa's instruction template and
   fence extractor, the child evaluated on the same minibatch;
4. a child kept by ``StrictImprovementAcceptance`` is validated on the valset and added to the
   archive (fronts updated), whatever its mean.

The parent's minibatch is free when the parent is the served tree and the minibatch is its own
recorded traffic: the reported scores and feedback are used as they are. Budget accounting counts
one metric call per scored episode, as upstream does, including those free ones.

``train`` returns a :class:`CandidateUpdate` only for a new candidate whose mean validation score
beats the served candidate's (GEPA serves its best): the gate then compares candidate and current
release on the valset (``eval_tasks``) through :meth:`run_task`, which re-uses the outputs GEPA's
validation produced. Everything else returns None: the archive still grew, nothing serves differently.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gepa.core.data_loader import ListDataLoader
from gepa.core.state import GEPAState, ValsetEvaluation
from gepa.logging.experiment_tracker import create_experiment_tracker
from gepa.proposer.merge import MergeProposer
from gepa.proposer.reflective_mutation.reflective_mutation import ReflectiveMutationProposer
from gepa.strategies.acceptance import ImprovementOrEqualAcceptance, StrictImprovementAcceptance
from gepa.strategies.batch_sampler import EpochShuffledBatchSampler
from gepa.strategies.candidate_selector import (
    CurrentBestCandidateSelector,
    EpsilonGreedyCandidateSelector,
    ParetoCandidateSelector,
    TopKParetoCandidateSelector,
)
from gepa.strategies.component_selector import (
    AllReflectionComponentSelector,
    RoundRobinReflectionComponentSelector,
)

from reef_core.api import (
    Batch,
    CandidateUpdate,
    ChatModel,
    Current,
    TrainContext,
    Trainer,
    TrainerSetup,
    ValidationFailed,
    encode_tree,
    resolve_chat_model,
    scenario_path,
    validate_tree,
)

from .adapter import HarnessAdapter, OutputCache, TaskRunner
from .archive import Archive
from .episodes import (
    Episode,
    default_feedback,
    load_callable,
    load_tasks,
    sample_episode,
    task_episode,
    task_key,
)
from .options import GepaOptions

log = logging.getLogger("reef_gepa")


class _GepaLog:
    """gepa's logger protocol, routed to Python logging (gepa prints by default)."""

    def log(self, message: str) -> None:
        log.debug("%s", message)


class TrafficSampler:
    """The minibatch is the whole batch of reported traffic (gepa ``BatchSampler`` protocol)."""

    def next_minibatch_ids(self, loader, state) -> list:
        return list(loader.all_ids())


class GepaTrainer(Trainer):
    """GEPA over a harness tree (see the module docstring)."""

    artifact_kind = "harness"

    def __init__(self, scenario: str, options: GepaOptions, setup: TrainerSetup, *,
                 task_model: ChatModel | None = None, reflection_model: ChatModel | None = None):
        self.scenario = scenario
        self.options = options
        self.seed = int(options.seed if options.seed is not None else setup.seed)
        run_async = getattr(setup, "run_async", None)
        self.task_model = task_model or resolve_chat_model(options.task_model, engine=setup.engine,
                                                           run_async=run_async, what="gepa task_model")
        self.reflection_model = reflection_model or resolve_chat_model(
            options.reflection_model, engine=setup.engine, run_async=run_async, what="gepa reflection_model")
        self.verifier = load_callable(options.verifier, "verifier")
        self.feedback = load_callable(options.feedback, "feedback") or default_feedback
        self.valset = load_tasks(options.valset, "valset")
        self.trainset = load_tasks(options.trainset, "trainset") if options.trainset is not None else None
        self.val_episodes = [task_episode(t) for t in self.valset]
        self.train_episodes = [task_episode(t) for t in self.trainset] if self.trainset is not None else None
        self.runner = TaskRunner(self.task_model, self.verifier, self.feedback, options.system_files,
                                 OutputCache(int(options.output_cache_size)))
        self.directory = scenario_path(Path(setup.data_dir) / "gepa", scenario)
        self.fingerprint = {
            "components": list(options.components),
            "system_files": list(options.system_files),
            "valset": [e.key for e in self.val_episodes],
            "trainset": [e.key for e in self.train_episodes] if self.train_episodes is not None else None,
            "minibatch_size": options.minibatch_size,
            "seed": self.seed,
        }
        self.archive = Archive.load(self.directory, self.fingerprint, self.seed)
        self._trees: dict[str | None, dict[str, str]] = {}
        self._lock = threading.RLock()

    # -- Trainer API ---------------------------------------------------------------------------------

    def initial_files(self) -> Mapping[str, bytes]:
        if not self.options.initial_files:
            return {}
        return encode_tree(validate_tree(self.options.initial_files))

    def train(self, batch: Batch, ctx: TrainContext) -> CandidateUpdate | None:
        with self._lock:
            tree = self._served_tree(ctx)
            adapter = HarnessAdapter(self.runner, tree, [i["text"] for i in batch.instructions])
            try:
                served = self._sync(adapter, tree, ctx.serving_release_id)
                if self._exhausted():
                    self._save()
                    log.info("gepa %s: budget of %s metric calls spent; batch not used", self.scenario,
                             self.options.max_metric_calls)
                    return None
                loader = self._minibatch_source(batch, self.runner.system_text(tree))
                if loader is None:
                    self._save()
                    return None
                outcome = self._iterate(adapter, loader)
                self._save()
            except BaseException:
                # Nothing half-done survives: the in-memory archive goes back to the last saved one.
                self.archive = Archive.load(self.directory, self.fingerprint, self.seed)
                raise
            if outcome is None:
                return None
            idx, proposal = outcome
            return self._update(adapter, idx, proposal, served)

    def run_task(self, subject: Any, task: dict) -> str:
        """The output of ``task`` run with the subject's tree (a gate ``Candidate`` or ``Current``)."""
        return self.runner.run_task(self._subject_tree(subject), task)

    def accepted(self, update: CandidateUpdate, release_id: str | None) -> None:
        idx = (update.source or {}).get("candidate")
        with self._lock:
            if isinstance(update.payload, Mapping):
                self._trees[release_id] = dict(update.payload)
            if isinstance(idx, int) and self.archive.state is not None and idx < self.archive.size:
                self.archive.served = idx
                if release_id:
                    self.archive.releases[release_id] = idx
                self._save()

    def rejected(self, update: CandidateUpdate) -> None:
        """Nothing to undo: the candidate stays in the archive (and on its fronts); the served one is unchanged."""

    def status(self) -> dict:
        with self._lock:
            return self.archive.summary()

    # -- the iteration ---------------------------------------------------------------------------------

    def _served_tree(self, ctx: TrainContext) -> dict[str, str]:
        raw = ctx.current_files() if ctx.current_files is not None else {}
        tree = validate_tree(raw) if raw else validate_tree(self.options.initial_files)
        self._trees[ctx.serving_release_id] = tree
        return tree

    def _components(self, tree: Mapping[str, str]) -> dict[str, str]:
        return {name: tree.get(name, "") for name in self.options.components}

    def _sync(self, adapter: HarnessAdapter, tree: Mapping[str, str], release_id: str | None) -> int:
        """Make the archive know the served components; return their candidate index."""
        archive = self.archive
        components = self._components(tree)
        if archive.state is None:
            evaluation = self._validate(adapter, components)
            state = GEPAState(components, evaluation, track_best_outputs=False, frontier_type="instance")
            state.num_full_ds_evals = 1
            state.total_num_evals = len(evaluation.scores_by_val_id)
            archive.state = state
            idx = 0
        else:
            idx = archive.find(components)
            if idx is None:
                # The tree moved without GEPA (operator edit, rollback to outside text): a parentless candidate.
                idx = self._add(components, [], self._validate(adapter, components))
        archive.served = idx
        if release_id:
            archive.releases[release_id] = idx
        return idx

    def _exhausted(self) -> bool:
        limit = self.options.max_metric_calls
        return limit is not None and self.archive.state.total_num_evals >= int(limit)

    def _minibatch_source(self, batch: Batch, served_text: str) -> ListDataLoader | None:
        traffic = [e for e in (sample_episode(s, served_text) for s in batch.samples) if e is not None]
        if self.train_episodes is None:
            if not traffic and batch.instructions and self.val_episodes:
                return ListDataLoader(list(self.val_episodes))  # an instruction alone reflects on the valset
            if not traffic:
                log.info("gepa %s: no usable reported traffic in batch %s", self.scenario, batch.batch_id)
                return None
            return ListDataLoader(traffic)
        # Sampled training tasks: recorded traffic answers a task for free when it matches by key.
        by_key = {e.key: e.traffic for e in traffic if e.traffic is not None}
        return ListDataLoader([e.with_traffic(by_key.get(e.key)) for e in self.train_episodes])

    def _validate(self, adapter: HarnessAdapter, candidate: dict[str, str]) -> ValsetEvaluation:
        ids = list(range(len(self.val_episodes)))
        result = adapter.evaluate(self.val_episodes, candidate, capture_traces=False)
        return ValsetEvaluation(outputs_by_val_id=dict(zip(ids, result.outputs)),
                                scores_by_val_id=dict(zip(ids, result.scores)), objective_scores_by_val_id=None)

    def _add(self, candidate: dict[str, str], parents: list[int], evaluation: ValsetEvaluation) -> int:
        """Add a validated candidate, as gepa's engine does after a full evaluation."""
        state = self.archive.state
        discovered_at = state.total_num_evals
        state.increment_evals(len(evaluation.scores_by_val_id))
        state.num_full_ds_evals += 1
        idx = state.update_state_with_new_program(
            parent_program_idx=list(parents), new_program=candidate, valset_evaluation=evaluation, run_dir=None,
            num_metric_calls_by_discovery_of_new_program=discovered_at)
        if state.full_program_trace:
            trace = state.full_program_trace[-1]
            trace["new_program_idx"] = idx
            trace.setdefault("new_program_indices", []).append(idx)
            trace["evaluated_val_indices"] = sorted(evaluation.scores_by_val_id)
        return idx

    def _iterate(self, adapter: HarnessAdapter, loader: ListDataLoader):
        """One iteration of gepa's engine loop; ``(new index, proposal)`` or None."""
        archive, opts = self.archive, self.options
        state = archive.state
        state.i += 1
        state.full_program_trace.append({"i": state.i})
        merge = self._merge_proposer(adapter) if opts.use_merge else None
        try:
            if merge is not None:
                if merge.merges_due > 0 and merge.last_iter_found_new_program:
                    proposal = merge.propose(state)
                    merge.last_iter_found_new_program = False
                    if proposal is not None and proposal.tag == "merge":
                        before = proposal.subsample_scores_before or [-math.inf, -math.inf]
                        if sum(proposal.subsample_scores_after or []) >= max(before):
                            idx = self._add(proposal.candidate, proposal.parent_program_ids,
                                            self._validate(adapter, proposal.candidate))
                            merge.merges_due -= 1
                            merge.total_merges_tested += 1
                            return idx, proposal
                        return None
                merge.last_iter_found_new_program = False
            proposals = self._reflective_proposer(adapter, loader).propose(state)
            if not proposals:
                return None
            proposal = proposals[0]
            criterion = (StrictImprovementAcceptance() if opts.acceptance == "strict_improvement"
                         else ImprovementOrEqualAcceptance())
            if not criterion.should_accept(proposal, state):
                return None
            idx = self._add(proposal.candidate, proposal.parent_program_ids,
                            self._validate(adapter, proposal.candidate))
            if merge is not None:
                merge.last_iter_found_new_program = True
                if merge.total_merges_tested < merge.max_merge_invocations:
                    merge.merges_due += 1
            return idx, proposal
        finally:
            if merge is not None:
                self._keep_merge_schedule(merge)

    def _reflective_proposer(self, adapter: HarnessAdapter, loader: ListDataLoader) -> ReflectiveMutationProposer:
        opts, archive = self.options, self.archive
        if self.train_episodes is None:
            sampler = TrafficSampler()
        else:
            if archive.sampler is None:
                archive.sampler = EpochShuffledBatchSampler(minibatch_size=opts.minibatch_size, rng=archive.rng)
            sampler = archive.sampler
        module_selector = (RoundRobinReflectionComponentSelector() if opts.module_selector == "round_robin"
                           else AllReflectionComponentSelector())
        return ReflectiveMutationProposer(
            logger=_GepaLog(), trainset=loader, adapter=adapter, candidate_selector=self._candidate_selector(),
            module_selector=module_selector, batch_sampler=sampler, perfect_score=float(opts.perfect_score),
            # An instruction asks for a change even where every score is already perfect.
            skip_perfect_score=bool(opts.skip_perfect_score) and not adapter.instructions,
            experiment_tracker=create_experiment_tracker(),
            reflection_lm=self._reflect, reflection_prompt_template=opts.reflection_prompt_template)

    def _candidate_selector(self):
        rng, name = self.archive.rng, self.options.candidate_selection_strategy
        if name == "pareto":
            return ParetoCandidateSelector(rng=rng)
        if name == "current_best":
            return CurrentBestCandidateSelector()
        if name == "epsilon_greedy":
            return EpsilonGreedyCandidateSelector(epsilon=0.1, rng=rng)
        return TopKParetoCandidateSelector(k=5, rng=rng)

    def _merge_proposer(self, adapter: HarnessAdapter) -> MergeProposer:
        def evaluator(inputs, program):
            result = adapter.evaluate(inputs, program, capture_traces=False)
            return result.outputs, result.scores, result.objective_scores

        opts, schedule = self.options, self.archive.merge
        merge = MergeProposer(logger=_GepaLog(), valset=ListDataLoader(self.val_episodes), evaluator=evaluator,
                              use_merge=True, max_merge_invocations=int(opts.max_merge_invocations),
                              val_overlap_floor=int(opts.merge_val_overlap_floor), rng=self.archive.rng)
        merge.merges_due = schedule.merges_due
        merge.total_merges_tested = schedule.total_merges_tested
        merge.last_iter_found_new_program = schedule.last_iter_found_new_program
        merge.merges_performed = schedule.merges_performed
        return merge

    def _keep_merge_schedule(self, merge: MergeProposer) -> None:
        schedule = self.archive.merge
        schedule.merges_due = merge.merges_due
        schedule.total_merges_tested = merge.total_merges_tested
        schedule.last_iter_found_new_program = merge.last_iter_found_new_program
        schedule.merges_performed = merge.merges_performed

    def _reflect(self, prompt: Any) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return self.reflection_model(messages)

    # -- results ---------------------------------------------------------------------------------------

    def _update(self, adapter: HarnessAdapter, idx: int, proposal, served: int) -> CandidateUpdate | None:
        archive = self.archive
        mean, served_mean = archive.mean(idx), archive.mean(served)
        log.info("gepa %s: candidate %d (parents %s, %s) validated at %.4f; served %d at %.4f", self.scenario, idx,
                 proposal.parent_program_ids, proposal.tag, mean, served, served_mean)
        if not mean > served_mean:
            return None
        tree = adapter.tree(archive.state.program_candidates[idx])
        metrics = {
            "gepa_candidate": idx,
            "gepa_parents": list(proposal.parent_program_ids),
            "gepa_tag": proposal.tag,
            "val_mean": mean,
            "served_val_mean": served_mean,
            "minibatch_before": sum(proposal.subsample_scores_before or []),
            "minibatch_after": sum(proposal.subsample_scores_after or []),
            "metric_calls": archive.state.total_num_evals,
            "iteration": archive.state.i,
            "archive_size": archive.size,
            "episodes_reused": adapter.reused,
        }
        return CandidateUpdate(
            files=encode_tree(tree), payload=tree, metrics=metrics,
            algorithm_state={"gepa": {"candidates": archive.size, "candidate": idx, "served": served,
                                      "metric_calls": archive.state.total_num_evals, "iteration": archive.state.i}},
            eval_tasks=[dict(t) for t in self.valset],
            source={"kind": "training", "recipe": "gepa", "candidate": idx,
                    "parents": list(proposal.parent_program_ids), "iteration": archive.state.i, "tag": proposal.tag})

    def _subject_tree(self, subject: Any) -> dict[str, str]:
        return subject_tree(subject, self._trees, self._lock, lambda: validate_tree(self.options.initial_files),
                            who="gepa")

    def _save(self) -> None:
        self.archive.save(self.directory)


def make_trainer(*, scenario: str, recipe: Any = None, trainer: Any = None, context: TrainerSetup, **_ignored):
    """The ``gepa`` trainer factory (``reef_register_trainers``); ``recipe`` is the RecipeConfig."""
    return GepaTrainer(scenario, GepaOptions.from_config(recipe.options if recipe is not None else None), context)


__all__ = ["GepaTrainer", "TrafficSampler", "make_trainer", "task_key", "Episode"]


def subject_tree(subject: Any, trees: Mapping[str | None, dict[str, str]], lock: Any,
                 seed: Callable[[], dict[str, str]], *, who: str) -> dict[str, str]:
    """The harness tree a gate task runs on: a candidate's payload or files, or the tree of a current release this
    trainer knows (``trees``, read under ``lock``); ``seed()`` before any release. Anything else is refused."""
    payload = getattr(subject, "payload", None)
    if isinstance(payload, Mapping):
        return dict(payload)
    files = getattr(subject, "files", None)
    if isinstance(files, Mapping) and files:
        return validate_tree(files)
    if isinstance(subject, Current):
        with lock:
            tree = trees.get(subject.release_id)
        if tree is not None:
            return tree
        if subject.release_id is None:
            return seed()
        raise ValidationFailed(f"{who}: release {subject.release_id} is not known to this trainer")
    raise ValidationFailed(f"{who} cannot run a task for {type(subject).__name__}")
