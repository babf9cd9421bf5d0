"""The trainer contract: a ready batch in, a candidate update out.

A recipe's trainer component (registered through ``reef_register_trainers``) is built per
scenario by ``factory(scenario=..., recipe=<recipe section>, trainer=<trainer section>,
context=<TrainerSetup>)`` and returns a :class:`Trainer`. The learner
(``reef_core.loop.learner``) calls :meth:`Trainer.train` on its own thread, off the request
path, then sends the returned :class:`CandidateUpdate` through the evaluation gate. Only a
selected candidate is published and activated; a rejected one changes nothing.

Weight recipes usually do not subclass :class:`Trainer` themselves: they supply an objective
(``reef_core.grow.objective.Objective``) and let a trainer backend (``torch``) run it.
Harness recipes return a new text tree in ``files``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..observe.processor import Batch


@dataclass
class TrainerSetup:
    """What a trainer factory may use besides its config sections."""

    data_dir: Path
    #: The deployment's engine (the served model): harness trainers run tasks and reflections on it.
    engine: Any = None
    #: Builds the local model the scenario starts from (weights trainers): ``() -> (model, tokenizer)``.
    load_base_model: Callable[[], tuple[Any, Any]] | None = None
    #: Builds the base model the scenario was created from, never a later checkpoint (the frozen reference of
    #: objectives, the base under a LoRA adapter): ``() -> (model, tokenizer)``; None: ``load_base_model``.
    load_reference_model: Callable[[], tuple[Any, Any]] | None = None
    seed: int = 0
    #: Run a coroutine on the server's event loop from the learner thread (e.g. engine calls).
    run_async: Callable[..., Any] | None = None
    #: The local engine's resolved device: where a weights trainer runs when ``trainer.device`` is unset.
    device: str | None = None
    #: The deployment's ``evaluation`` section (a weights trainer reads ``options.generation`` for gate replies).
    evaluation: Any = None
    #: The recipe's batch size (``recipe.processor_options.batch_size``) when it sets one: a backend that runs one
    #: step per batch elsewhere checks its own batch setting against it (slime's ``--global-batch-size``).
    batch_size: int | None = None


@dataclass
class TrainContext:
    """The scenario's state when a batch is ready."""

    scenario: str
    #: Number of the step this batch would commit (last committed step + 1).
    step: int
    #: Release now serving the scenario (None before the first publication).
    serving_release_id: str | None
    #: Engine version now serving the scenario (``<incarnation>:<sequence>`` for weights; a LoRA scenario's own line
    #: ``<incarnation>.<key>:<sequence>``).
    serving_version: str | None
    #: Algorithm state committed with the previous step (JSON), or None.
    algorithm_state: Any
    #: Files of the serving release (harness text trees), read lazily.
    current_files: Callable[[], Mapping[str, bytes]] = field(default=lambda: {})


@dataclass
class CandidateUpdate:
    """A proposed update. ``files`` is what a durable release stores; ``payload`` is the
    in-memory form a surface may activate directly (e.g. a state dict between checkpoints)."""

    files: Mapping[str, Any]
    payload: Any = None
    metrics: dict = field(default_factory=dict)
    algorithm_state: Any = None
    #: Tasks the gate evaluates candidate and current release on (dicts; may be empty).
    eval_tasks: list = field(default_factory=list)
    #: Provenance recorded in the release manifest's ``source``.
    source: dict = field(default_factory=dict)


class Trainer(ABC):
    """Turns ready batches into candidate updates for one scenario."""

    #: ``weights`` or ``harness``: which surface serves this trainer's releases.
    artifact_kind: str = "weights"

    @abstractmethod
    def train(self, batch: Batch, ctx: TrainContext) -> CandidateUpdate | None:
        """Build a candidate from ``batch``; return None to skip (the batch is still consumed)."""

    def run_task(self, subject: Any, task: dict) -> Any:
        """Produce an output for ``task`` with ``subject`` (a gate ``Candidate`` or ``Current``).

        Used by task evaluators of the gate; trainers that support evaluation override it."""
        raise NotImplementedError(f"{type(self).__name__} cannot run evaluation tasks")

    def accepted(self, update: CandidateUpdate, release_id: str | None) -> None:
        """The candidate was selected and published (or activated live)."""

    def rejected(self, update: CandidateUpdate) -> None:
        """The candidate was rejected: roll any in-memory state back to the serving version."""

    def initial_files(self) -> Mapping[str, Any]:
        """Files of a scenario's first release (``creation``); empty for none."""
        return {}

    def close(self) -> None:
        """The learner stops: release what the trainer holds outside this process (e.g. Ray workers)."""
