"""The narrow ports through which the loop's parts reach the running deployment.

A surface and a learner never see the :class:`~reef_core.loop.deployment.Deployment`; they get
only what they use, so a new recipe, surface or test can provide these few pieces without
building a whole deployment:

* :class:`ServingPorts`: what a surface factory receives (``factory(ports=..., options=...)``):
  the engine, the artifact store, a way to run a coroutine on the server's event loop, and the
  base-model loader (weights restores). It is the surface's side of the contract, so it is defined
  with :class:`~reef_core.surfaces.base.Surface` (surfaces stand below the loop) and named here.
* :class:`LearnerPorts`: what a scenario's learner receives: the serving ports plus the record
  store (as :class:`RecordPort`), the plugin manager's ``create`` for the components it builds
  (processor, trainer, evaluator, selection policy), lifecycle ``notify``, and the worker pool.
* :class:`LearnerSettings`: the config pieces a learner reads (per recipe: its trainer and gate).
* :class:`ScenarioView`: what a recipe's scenario route (``reef_register_scenario_routes``) may read of one
  running scenario.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..config.schema import EvaluationConfig, TrainerConfig
from ..surfaces.base import RunAsync, ServingPorts  # noqa: F401 (named here with the other ports)
from .pool import LearnerPool


class RecordPort(Protocol):
    """The part of the record store a learner uses: its scenario's stream, consumption marks, and records read
    back by id when a sample is built."""

    def replay(self, scenario: str, after_sequence: int = 0) -> Iterator[Any]: ...

    def consumed_ids(self, scenario: str) -> set[str]: ...

    def mark_consumed(self, scenario: str, ids: Iterable[str], step: int) -> int: ...

    def get_many(self, ids: Iterable[str]) -> list[Any]: ...


@dataclass(frozen=True)
class LearnerPorts:
    """What a scenario's learner may use of the deployment."""

    serving: ServingPorts
    records: RecordPort
    #: ``create(kind, name, **kwargs)``: the plugin manager's factory for registered components.
    create: Callable[..., Any]
    #: ``notify(hook_name, **kwargs)``: lifecycle hooks (``reef_release_published``).
    notify: Callable[..., None]
    #: The worker pool that gives the learner its turns.
    pool: LearnerPool
    #: ``commit_log(scenario)``: the scenario's commit log opened as its writer; None: the file log under
    #: ``settings.commits_dir`` (PostgreSQL deployments keep it in the database, ``reef_core.commit.pg_log``).
    commit_log: Callable[[str], Any] | None = None


@dataclass(frozen=True)
class LearnerSettings:
    """The config a learner reads: deployment-wide ``data_dir`` and ``seed``, and the ``trainer`` and
    ``evaluation`` sections of the scenario's recipe (its own composition when routed, see
    ``reef_core.config.recipes``)."""

    data_dir: Path
    seed: int
    #: The recipe's ``trainer`` section (handed to trainer factories as ``trainer=``).
    trainer: TrainerConfig
    #: The recipe's ``evaluation`` section: ``policy``, ``evaluator``, ``options``, ``publish``.
    evaluation: EvaluationConfig

    @property
    def commits_dir(self) -> Path:
        return self.data_dir / "commits"

    @property
    def release_metrics_dir(self) -> Path:
        return self.data_dir / "release-metrics"

    @property
    def checkpoint_every(self) -> int:
        return max(1, self.trainer.checkpoint_every_n_versions)


@dataclass(frozen=True)
class ScenarioView:
    """One running scenario as a recipe's route handler sees it (read-only by contract)."""

    name: str
    #: The scenario's ``recipe`` section (``RecipeConfig``: its options, processor options...).
    recipe: Any
    #: The scenario's processor (``reef_core.api.Processor``), or None for a recipe without one.
    processor: Any
    #: ``() -> str | None``: the version serving the scenario's next request.
    serving_version: Callable[[], str | None]
    #: ``() -> Trainer | None``: the scenario's trainer, built on first use (a weights trainer loads no model then).
    trainer: Callable[[], Any]
    #: ``() -> str | None``: the id of the release serving the scenario now (read at call time).
    current_release_id: Callable[[], str | None]
    #: ``(release_id) -> Mapping[str, bytes]``: the files of one of the scenario's releases.
    release_files: Callable[[str], Mapping[str, Any]]
