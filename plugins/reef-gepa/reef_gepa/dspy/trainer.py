"""The ``dspy_gepa`` trainer: compile the scenario's DSPy program with ``dspy.GEPA`` on reported records.

Each batch of reports adds its examples to the scenario's pool (``<data_dir>/dspy_gepa/<scenario>/
examples.json``; :mod:`reef_gepa.dspy.records` reads the inputs back from the recorded requests by the
program's signature). A fixed fraction of examples (``holdout``, chosen by a digest of the inputs) is
held out for the gate; once there are ``min_train_examples`` to train on and ``min_heldout_examples``
held out, ``dspy.GEPA`` compiles the served program on the training examples within
``max_metric_calls``, and a compiled program that differs from the served one is the candidate.

The metric of an answer the served program gave is its report: the reported score, and the report's
feedback as GEPA's textual feedback. A different answer (a candidate's) was never reported, so it is
scored by the configured checker ``metric`` (``fn(example, prediction)`` or DSPy's five-argument GEPA
metric; a float, or ``{score, feedback}``), with the report's labels (``metadata.labels``) on the example.

The gate runs candidate and served program on the held-out examples (:meth:`DspyGepaTrainer.run_task`
returns the prediction and its metric score, which :func:`gate_score` reads) and ``score_comparison``
decides, as for the ``gepa`` trainer.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reef_core.api import (
    Batch,
    CandidateUpdate,
    ConfigError,
    TrainContext,
    Trainer,
    TrainerSetup,
    encode_tree,
    load_object,
    option_values,
    resolve_chat_model,
    scenario_path,
    validate_tree,
)

from . import PROGRAM_FILE, chat_lm, import_dspy, load_program, program_files, program_signature, read_manifest
from .records import example_key, example_of, held_out
from ..trainer import subject_tree

log = logging.getLogger("reef_gepa.dspy")


@dataclass
class DspyGepaOptions:
    #: ``pkg.mod:Class`` of the program (a ``dspy.Module`` built with no argument); its state is the seed release.
    program: str | None = None
    #: ``pkg.mod:fn``: the checker scoring answers no report scored (see the module docstring). Required.
    metric: str | None = None
    #: dspy.GEPA's budget per compilation, in metric calls.
    max_metric_calls: int = 200
    #: Fraction of examples held out for the gate (by a digest of their inputs).
    holdout: float = 0.25
    min_train_examples: int = 4
    min_heldout_examples: int = 1
    #: The newest examples kept in the pool.
    max_examples: int = 1024
    reflection_minibatch_size: int = 3
    candidate_selection_strategy: str = "pareto"
    skip_perfect_score: bool = True
    use_merge: bool = False
    num_threads: int = 1
    #: dspy.GEPA's seed (None: the deployment's ``seed``).
    seed: int | None = None
    #: The LM running the program while compiling and for the gate, and GEPA's reflection LM:
    #: null/'served' (the deployment's engine), ``pkg.mod:fn(messages) -> str``, or ``{url, model, api_key_env}``.
    task_model: Any = None
    reflection_model: Any = None

    @classmethod
    def from_config(cls, options: Mapping[str, Any] | None) -> "DspyGepaOptions":
        opts = cls(**option_values(cls, options, who="dspy_gepa"))
        opts._check()
        return opts

    def _check(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"dspy_gepa: {message}")

        need(isinstance(self.program, str) and ":" in self.program, "options.program (pkg.module:Class) is required")
        need(isinstance(self.metric, str) and bool(self.metric), "options.metric (pkg.module:function) is required")
        need(isinstance(self.max_metric_calls, int) and self.max_metric_calls > 0, "max_metric_calls must be positive")
        need(isinstance(self.holdout, (int, float)) and 0 < float(self.holdout) < 1, "holdout must be in (0, 1)")
        need(int(self.min_train_examples) >= 1 and int(self.min_heldout_examples) >= 1,
             "min_train_examples and min_heldout_examples must be >= 1")
        need(int(self.max_examples) >= 2, "max_examples must be >= 2")
        need(int(self.reflection_minibatch_size) >= 1, "reflection_minibatch_size must be >= 1")
        need(self.candidate_selection_strategy in ("pareto", "current_best"),
             "candidate_selection_strategy must be pareto or current_best")
        need(int(self.num_threads) >= 1, "num_threads must be >= 1")


def _score_and_feedback(value: Any) -> tuple[float, str | None]:
    """A metric's verdict (a number, or a mapping / Prediction with ``score`` and ``feedback``)."""
    if isinstance(value, (int, float, bool)) or value is None:
        score, feedback = value, None
    else:
        try:
            score, feedback = value["score"], value.get("feedback") if hasattr(value, "get") else None
        except (KeyError, TypeError):
            score, feedback = getattr(value, "score", None), getattr(value, "feedback", None)
    score = 0.0 if score is None else float(score)
    return (0.0 if math.isnan(score) else score), (None if feedback is None else str(feedback))


def gate_score(output: Any, task: dict) -> float | None:
    """The gate's scorer (``evaluation.options.evaluator.path``): the metric score ``run_task`` computed."""
    return output.get("score") if isinstance(output, Mapping) else None


class DspyGepaTrainer(Trainer):
    """dspy.GEPA over a DSPy program served as a harness tree (see the module docstring)."""

    artifact_kind = "harness"

    def __init__(self, scenario: str, options: DspyGepaOptions, setup: TrainerSetup, *,
                 task_model: Any = None, reflection_model: Any = None):
        self.dspy = import_dspy()
        self.scenario = scenario
        self.options = options
        self.seed = int(options.seed if options.seed is not None else setup.seed)
        cls = load_object(options.program)
        self.seed_program = cls()
        if not isinstance(self.seed_program, self.dspy.Module):
            raise ConfigError(f"dspy_gepa: {options.program} is not a dspy.Module")
        signature = program_signature(self.seed_program)
        self.input_fields = list(signature.input_fields)
        self.output_fields = list(signature.output_fields)
        self.metric = load_object(options.metric)
        if not callable(self.metric):
            raise ConfigError(f"dspy_gepa: metric {options.metric!r} is not callable")
        self._metric_arity = _arity(self.metric)
        run_async = getattr(setup, "run_async", None)
        task = task_model or resolve_chat_model(options.task_model, engine=setup.engine, run_async=run_async,
                                                what="dspy_gepa task_model")
        reflection = reflection_model or resolve_chat_model(options.reflection_model, engine=setup.engine,
                                                            run_async=run_async, what="dspy_gepa reflection_model")
        self.task_lm = chat_lm(task, "task")
        self.reflection_lm = chat_lm(reflection, "reflection")
        self.directory = scenario_path(Path(setup.data_dir) / "dspy_gepa", scenario)
        self.examples: dict[str, dict] = self._load()
        self._trees: dict[str | None, dict[str, str]] = {}
        self._calls = {"reported": 0, "checked": 0}
        self._lock = threading.RLock()

    # -- Trainer API ---------------------------------------------------------------------------------

    def initial_files(self) -> Mapping[str, bytes]:
        return encode_tree(program_files(self.seed_program, self.options.program))

    def train(self, batch: Batch, ctx: TrainContext) -> CandidateUpdate | None:
        dspy = self.dspy
        with self._lock:
            tree = self._served_tree(ctx)
            added = self._add_examples(batch)
            train, heldout = self._split()
            if len(train) < int(self.options.min_train_examples) or len(heldout) < int(self.options.min_heldout_examples):
                log.info("dspy_gepa %s: %d train / %d held-out examples; waiting for more reports", self.scenario,
                         len(train), len(heldout))
                return None
            student = load_program(tree)
            self._calls = {"reported": 0, "checked": 0}
            optimizer = dspy.GEPA(
                metric=self._gepa_metric, max_metric_calls=int(self.options.max_metric_calls),
                reflection_lm=self.reflection_lm, reflection_minibatch_size=int(self.options.reflection_minibatch_size),
                candidate_selection_strategy=self.options.candidate_selection_strategy,
                skip_perfect_score=bool(self.options.skip_perfect_score), use_merge=bool(self.options.use_merge),
                num_threads=int(self.options.num_threads), seed=self.seed, warn_on_score_mismatch=False)
            with dspy.context(lm=self.task_lm):
                compiled = optimizer.compile(student, trainset=[self._example(e) for e in train])
            manifest = read_manifest(tree)
            candidate = program_files(compiled, manifest["program"])
        if candidate[PROGRAM_FILE] == tree[PROGRAM_FILE]:
            log.info("dspy_gepa %s: GEPA kept the served program", self.scenario)
            return None
        metrics = {"examples_added": added, "train_examples": len(train), "heldout_examples": len(heldout),
                   "max_metric_calls": int(self.options.max_metric_calls),
                   "metric_calls_reported": self._calls["reported"], "metric_calls_checked": self._calls["checked"]}
        return CandidateUpdate(
            files=encode_tree(candidate), payload=candidate, metrics=metrics,
            eval_tasks=[{"id": e["key"], "inputs": e["inputs"], "labels": e["labels"]} for e in heldout],
            source={"kind": "training", "recipe": "gepa_dspy", "optimizer": "dspy.GEPA",
                    "train_examples": len(train)})

    def run_task(self, subject: Any, task: dict) -> dict:
        """``{outputs, score, feedback}`` of ``task`` (a held-out example) run by the subject's program."""
        program = load_program(self._subject_tree(subject))
        example = self.dspy.Example(**task.get("labels", {}), **task["inputs"]).with_inputs(*task["inputs"])
        with self.dspy.context(lm=self.task_lm):
            prediction = program(**task["inputs"])
        score, feedback = self._score(example, prediction)
        return {"outputs": self._outputs(prediction), "score": score, "feedback": feedback}

    def accepted(self, update: CandidateUpdate, release_id: str | None) -> None:
        if isinstance(update.payload, Mapping):
            with self._lock:
                self._trees[release_id] = dict(update.payload)

    def status(self) -> dict:
        with self._lock:
            train, heldout = self._split()
            return {"examples": len(self.examples), "train_examples": len(train), "heldout_examples": len(heldout)}

    # -- examples --------------------------------------------------------------------------------------

    def _add_examples(self, batch: Batch) -> int:
        added = 0
        for sample in batch.samples:
            example = example_of(sample, self.input_fields, self.output_fields)
            if example is None:
                continue
            self.examples.pop(example["key"], None)  # the newest report of an example wins (and moves last)
            self.examples[example["key"]] = example
            added += 1
        while len(self.examples) > int(self.options.max_examples):
            self.examples.pop(next(iter(self.examples)))
        self._save()
        return added

    def _split(self) -> tuple[list[dict], list[dict]]:
        train, heldout = [], []
        for example in self.examples.values():
            (heldout if held_out(example["key"], float(self.options.holdout)) else train).append(example)
        return train, heldout

    def _example(self, entry: dict) -> Any:
        return self.dspy.Example(**entry["labels"], **entry["inputs"]).with_inputs(*entry["inputs"])

    def _outputs(self, prediction: Any) -> dict[str, str]:
        return {name: str(prediction.get(name, "")) if hasattr(prediction, "get") else "" for name in self.output_fields}

    # -- the metric ------------------------------------------------------------------------------------

    def _score(self, gold: Any, prediction: Any, trace=None, pred_name=None, pred_trace=None) -> tuple[float, str | None]:
        if self._metric_arity >= 5:
            return _score_and_feedback(self.metric(gold, prediction, trace, pred_name, pred_trace))
        return _score_and_feedback(self.metric(gold, prediction))

    def _gepa_metric(self, gold, pred, trace=None, pred_name=None, pred_trace=None):
        """The report of an answer the served program gave; the checker for any other answer."""
        entry = self.examples.get(example_key({name: gold[name] for name in self.input_fields}))
        recorded = entry["recorded"] if entry else None
        outputs = self._outputs(pred)
        if recorded and recorded.get("outputs") is not None and recorded["outputs"] == outputs:
            score, feedback = recorded["score"], recorded.get("feedback")
            self._calls["reported"] += 1
        else:
            score, feedback = self._score(gold, pred, trace, pred_name, pred_trace)
            self._calls["checked"] += 1
        return self.dspy.Prediction(score=score, feedback=feedback or f"This answer scored {score:.3f}.")

    # -- trees -----------------------------------------------------------------------------------------

    def _served_tree(self, ctx: TrainContext) -> dict[str, str]:
        raw = ctx.current_files() if ctx.current_files is not None else {}
        tree = validate_tree(raw) if raw else program_files(self.seed_program, self.options.program)
        read_manifest(tree)
        self._trees[ctx.serving_release_id] = tree
        return tree

    def _subject_tree(self, subject: Any) -> dict[str, str]:
        return subject_tree(subject, self._trees, self._lock,
                            lambda: program_files(self.seed_program, self.options.program), who="dspy_gepa")

    # -- persistence -----------------------------------------------------------------------------------

    def _load(self) -> dict[str, dict]:
        path = self.directory / "examples.json"
        if not path.exists():
            return {}
        rows = json.loads(path.read_text())
        return {row["key"]: row for row in rows}

    def _save(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "examples.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(self.examples.values()), sort_keys=True))
        os.replace(tmp, path)


def _arity(func: Any) -> int:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 5
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def make_trainer(*, scenario: str, recipe: Any = None, trainer: Any = None, context: TrainerSetup, **_ignored):
    """The ``dspy_gepa`` trainer factory (``reef_register_trainers``)."""
    return DspyGepaTrainer(scenario, DspyGepaOptions.from_config(recipe.options if recipe is not None else None),
                           context)


__all__ = ["DspyGepaOptions", "DspyGepaTrainer", "gate_score", "make_trainer"]
