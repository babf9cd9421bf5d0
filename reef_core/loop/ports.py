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
* :class:`ServePorts`: every call the HTTP layer (``serve/``) makes, named as what it wants done; the
  :class:`~reef_core.loop.deployment.Deployment` implements it, and ``serve/`` reaches no store, artifact store or
  plugin manager behind it (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..config.schema import EvaluationConfig, ServerConfig, TrainerConfig
from ..surfaces.base import RunAsync, ServingPorts  # noqa: F401 (named here with the other ports)
from .pool import LearnerPool


class RecordPort(Protocol):
    """The part of the record store a learner uses: its scenario's stream, consumption marks, and records read
    back by id when a sample is built."""

    def replay(self, scenario: str, after_sequence: int = 0) -> Iterator[Any]: ...

    def consumed_ids(self, scenario: str) -> set[str]: ...

    def mark_consumed(self, scenario: str, ids: Iterable[str], step: int) -> int: ...

    def get_many(self, scenario: str, ids: Iterable[str]) -> list[Any]: ...


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


class ServePorts(Protocol):
    """What ``serve/`` asks of the running deployment: one method per intent, plain values in and out.

    Blocking reads (``find_*``, ``list_*``, ``*_page``, ``release_*``) run on a worker thread
    (``asyncio.to_thread``); the ``async`` ones run on the event loop."""

    #: The ``server`` config section (limits, auth, metrics); the HTTP layer reads no other section.
    server: ServerConfig
    #: The engine that answers inference (its streams are relayed as they come).
    engine: Any
    #: ``server.workers`` (``serve/process/``): set by a worker process, called with the scenario of each durable
    #: batch of records it stored; set by the primary, called with what its workers must hear (a head moved, a
    #: scenario archived).
    on_records: Callable[[str], None] | None
    tell_workers: Callable[[dict], None] | None

    # -- scenarios --
    async def resolve(self, name: str) -> Any: ...
    async def create_scenario(self, name: str) -> Any: ...
    def find_scenario(self, name: str) -> Any: ...
    def list_scenarios(self) -> list[Any]: ...
    def is_active(self, name: str) -> bool: ...
    def serves_a_seed(self, scenario: Any) -> bool: ...
    def surface_for(self, scenario: Any) -> Any: ...
    def recipe(self, scenario: Any) -> Any: ...
    def serving_version(self, scenario: Any) -> str | None: ...
    def scenario_view(self, scenario: Any) -> ScenarioView: ...
    def provisional_view(self, name: str) -> ScenarioView | None: ...
    def archive_scenario(self, name: str) -> None: ...

    # -- one inference (loop/inference.py) --
    def find_retry(self, scenario: str, request_hash: str, record_id: str, *, client_record_id: str | None,
                   idempotency_key: str | None, sdk_retry: bool, own_id: Any = None) -> Any: ...
    async def plan_inference(self, scenario: Any, client_dialect: str, route: str, body: dict,
                             forward_headers: dict[str, str], pin: str | None = None) -> Any: ...

    # -- records --
    async def record_stored(self, record: Any, idempotency_key: str | None = None) -> Any: ...
    async def records_stored(self, records: list, *, check_references: bool = True) -> list: ...
    def find_record(self, scenario: str, record_id: str) -> Any: ...
    def find_by_idempotency_key(self, scenario: str, key: str) -> Any: ...
    def find_recent_by_request_hash(self, scenario: str, request_hash: str) -> Any: ...
    def records_page(self, scenario: str, after_sequence: int, limit: int) -> list[Any]: ...
    def last_sequence(self, scenario: str) -> int: ...
    def report_schema(self, scenario: Any) -> Any: ...
    def report_key(self, scenario: Any, report: dict) -> str | None: ...

    # -- releases and learning --
    def find_release(self, release_id: str) -> Any: ...
    def release_files(self, release_id: str) -> Mapping[str, Any]: ...
    def release_rows(self, scenario: str) -> list[dict]: ...
    def evaluation_runs(self, scenario: str, limit: int) -> list[dict]: ...
    def release_scores(self, scenario: Any) -> dict: ...
    def compare_releases(self, scenario: Any, a: str, b: str) -> dict: ...
    def republish(self, scenario: Any, operation: str, release_id: str, note: dict | None = None) -> Any: ...
    def list_aliases(self, scenario: Any) -> dict: ...
    def move_alias(self, scenario: Any, name: str, release_id: Any, reason: Any, by: str) -> dict: ...
    def alias_history(self, scenario: Any, name: str, limit: int) -> dict: ...
    async def evaluate(self, scenario: Any, release: str, messages: list, options: dict) -> dict: ...
    def commit_rows(self, scenario: Any, after_step: int | None, limit: int, record_id: str | None) -> Any: ...
    def preview_samples(self, scenario: Any, limit: int) -> list[Any]: ...
    def close_batch(self, scenario: Any) -> tuple[int, Any]: ...
    def scenario_status(self, scenario: Any) -> dict: ...
    def status(self) -> dict: ...

    # -- the process --
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def records_arrived(self, scenario: str) -> None: ...
    def follow_head(self, scenario: str) -> None: ...
    def forget_scenario(self, scenario: str) -> None: ...
    def harness_adapter(self, name: str) -> Any: ...
    def announce_startup(self) -> None: ...
    def model_ids(self) -> list[str]: ...
    def learners(self) -> dict[str, Any]: ...
    def writer_stats(self) -> Any: ...
    def plugin_failures(self) -> Mapping[str, str]: ...
    def usage_rows(self, periods: list[str]) -> list[tuple[str, str, int, int]]: ...
    def add_usage(self, rows: list[tuple[str, str, int, int]]) -> None: ...
