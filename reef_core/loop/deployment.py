"""The running deployment: config, plugins, record store, engine, artifacts and learners.

One object owns what a ``reef serve`` process holds, so the HTTP layer stays thin. The loop's
parts do not reach back into it: surfaces get :class:`~reef_core.loop.ports.ServingPorts`,
learners :class:`~reef_core.loop.ports.LearnerPorts` and
:class:`~reef_core.loop.ports.LearnerSettings`; all learners share one
:class:`~reef_core.loop.pool.LearnerPool` (``trainer.learner_workers`` threads).

Every recipe runs with its own composition (:class:`~reef_core.config.recipes.RecipeBinding`): a scenario's
processor, trainer, surface and their options come from its recipe's ``recipe`` section, and its learner's
settings (the trainer factory's ``trainer`` section, the gate's ``evaluation`` section) from the same recipe.
Surfaces are built once per (surface name, surface options), so two recipes' harness surfaces keep their own
options; a weights surface is built once per deployment, since the engine holds one set of base weights.

Roles (``role``): ``all`` (``reef serve``, the default) serves and runs the learners; ``serve``
(``server.learner=false``) serves only, each scenario a :class:`~reef_core.loop.follower.ScenarioFollower` of
the head a learner process publishes; ``learn`` (``reef learn``) runs the learners only. With a PostgreSQL
record store the commit logs live in the database and a learner runs only while its process holds the
scenario's lease (:mod:`reef_core.loop.lease`); a ``reef serve`` whose scenario's lease another process holds
serves that scenario as a follower, and takes the learner over when the lease frees (:meth:`_serve_round`).
"""

from __future__ import annotations

import asyncio
import functools
import fnmatch
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from ..commit.commitlog import CommitLog, WriterLock
from ..commit.pg_log import PgCommitLog
from ..commit.release import scenario_path
from ..config.recipes import RecipeBinding, check_components, composite_parts, recipe_bindings
from ..config.schema import ReefConfig
from ..errors import ConfigError, Conflict, NotFound, ReefError, ScenarioQuarantined, ValidationFailed
from ..grow.eval_engine import EvalGeneration
from ..observe.instructions import TRAINING_MODES
from ..observe.records import RecordStore, Scenario
from . import inference, rollout
from .evaluate import Evaluator
from .follower import HeadWatcher, ScenarioFollower, head_channel, notify_head_moved
from .lease import LeaseHolder, psycopg_dsn
from .pool import LearnerPool
from .record_retention import RetentionWorker
from .ports import LearnerPorts, LearnerSettings, ServingPorts
from .taskfile import load_tasks
from ..surfaces.composite import CompositeSurface, changed_kinds

log = logging.getLogger("reef.serve")

__all__ = ["Deployment", "RecipeBinding", "ROLES"]

#: What a process does: serve and learn (``reef serve``), serve only (``server.learner=false``), learn only
#: (``reef learn``).
ROLES = ("all", "serve", "learn")


class Deployment:
    def __init__(self, cfg: ReefConfig, plugin_manager, store: RecordStore, engine, artifacts,
                 role: str | None = None, tracing=None):
        role = role or ("all" if cfg.server.learner else "serve")
        if role not in ROLES:
            raise ConfigError(f"deployment role must be one of {', '.join(ROLES)}, not {role!r}")
        self.role = role
        self.cfg = cfg
        self.pm = plugin_manager
        self.store = store
        self.engine = engine
        self.artifacts = artifacts
        #: ``observability.tracing``'s exporter (:class:`~reef_core.observe.tracing.Tracing`), None when off: told
        #: every lifecycle notification after the plugins, it only watches.
        self.tracing = tracing
        self.data_dir = Path(cfg.storage.data_dir)
        self.recipes = self._load_recipes()
        self._settings = {name: LearnerSettings(data_dir=self.data_dir, seed=cfg.seed, trainer=binding.trainer,
                                                evaluation=binding.evaluation)
                          for name, binding in self.recipes.items()}
        self._scenarios: dict[str, Scenario] = {}
        self._scenario_lock = asyncio.Lock()
        self._report_schemas: dict[str, Any] = {}
        self._surfaces: dict[tuple[str, str], Any] = {}  # (surface name, its options as JSON) -> instance
        self._composites: dict[str, Any] = {}  # a composite recipe's settings as JSON -> its CompositeSurface
        self._learners: dict[str, Any] = {}
        self._learners_lock = threading.RLock()  # also guards the writer lock, taken by start() or a learner
        self._quarantined: dict[str, str] = {}  # scenario -> why it could not start
        #: ``ab`` rollouts: scenario -> (the head the arms were resolved under, [(arm, release id or None)]).
        self._ab_arms: dict[str, tuple[str | None, list]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer_lock: WriterLock | None = None
        self.pool = LearnerPool(workers=cfg.trainer.learner_workers)
        #: Record retention (``storage.retention``): background compaction passes and their counts.
        self.retention = RetentionWorker(store, cfg.storage.retention, scenarios=self._retained_scenarios,
                                         protected=self._protected_records)
        #: The private engine of evaluate calls (loop/evaluate.py): built on the first, loading nothing before.
        self.evaluator = Evaluator(cfg, plugin_manager)
        self.serving_ports = ServingPorts(engine=engine, artifacts=artifacts, run_async=self.run_async,
                                          load_base_model=self.load_base_model)
        #: Commit logs and leases in the database when the record store is PostgreSQL (shared by processes).
        self.shared = store.dialect == "postgresql"
        self._leases: LeaseHolder | None = None
        self._watcher: HeadWatcher | None = None
        #: ``server.workers`` (:mod:`reef_core.serve.process.workers`): in a worker, told the scenario of each durable
        #: batch of records (the primary wakes its learner); in the primary, the channel to its workers, told
        #: ``{"head": scenario}`` when a head moved and ``{"archived": scenario}`` when a scenario was deleted.
        self.on_records = None
        self.tell_workers = None
        self.learner_ports = LearnerPorts(serving=self.serving_ports, records=store, create=plugin_manager.create,
                                          notify=self._notify, pool=self.pool,
                                          commit_log=self._shared_log if self.shared else None)
        #: The default recipe's settings (deployment-wide paths: the commit logs' directory).
        self.learner_settings = self._settings[cfg.recipe.name]
        # Build every recipe's surface now: an impossible pairing (a weights recipe on an engine that
        # cannot swap weights) fails at start-up with a clear message, not on the first request.
        # A missing or malformed evaluation task file (or evaluation reply settings) fails at start-up too, naming
        # its key (and its recipe).
        for name, binding in self.recipes.items():
            EvalGeneration.from_options(binding.evaluation.options.get("generation"))
            if binding.evaluation.tasks:
                load_tasks(binding.evaluation.tasks, key="evaluation.tasks" if name == cfg.recipe.name
                           else f"evaluation.tasks of recipe {name!r}")
        for binding in self.recipes.values():
            surface = self.recipe_surface(binding.config, "" if binding.default else f"{binding.where()}: ")
            rollout.check_binding(binding, surface, role=self.role, workers=cfg.server.workers)

    # -- recipes and scenarios ----------------------------------------------------------------

    def _load_recipes(self) -> dict[str, RecipeBinding]:
        """Every recipe this deployment runs, each with its own sections (see ``reef_core.config.recipes``)."""
        from ..models.device import trainer_device

        recipes = recipe_bindings(self.cfg, self.pm)
        for binding in recipes.values():
            # Fail at start-up, naming the available components, rather than on first use.
            check_components(binding, self.pm)
            if binding.config.training_mode not in TRAINING_MODES:
                raise ConfigError(f"{binding.where()}: recipe.training_mode must be one of "
                                  f"{', '.join(TRAINING_MODES)}, not {binding.config.training_mode!r}")
            if not binding.default and binding.trainer.device is not None:
                try:  # the default recipe's device was checked with the engine's (assemble.check_devices)
                    trainer_device(binding.trainer, self.cfg.engine)
                except ConfigError as exc:
                    raise ConfigError(f"{binding.where()}: {exc.message}", **exc.details) from None
            if binding.trainer.backend == "ray" and binding.config.trainer:
                # Ray's extra and trainer.options.ray are checked now: the trainer itself is built on a first batch.
                from ..extras import require
                from ..grow.ray_backend import RayOptions

                require("ray", f"{binding.where()}: trainer.backend=ray")
                RayOptions.from_config(binding.trainer.options, who=binding.where())
        return recipes

    def recipe_for_new_scenario(self, name: str) -> str:
        """The recipe a new scenario is bound to: first matching route, else the default recipe."""
        for route in self.cfg.routes:
            if fnmatch.fnmatchcase(name, route.pattern):
                return route.recipe
        return self.cfg.recipe.name

    def recipe(self, scenario: Scenario) -> RecipeBinding:
        try:
            return self.recipes[scenario.recipe]
        except KeyError:
            raise ConfigError(
                f"scenario {scenario.name!r} is bound to recipe {scenario.recipe!r}, which this deployment "
                f"does not load; add a route for it or serve it with +recipe={scenario.recipe}"
            ) from None

    async def resolve(self, name: str) -> Scenario:
        """The scenario a request names, creating nothing: the stored one (its learner started), or, for a new
        name, a provisional binding to the recipe the routes give it. The row is written only with the first
        record stored for it (:meth:`record_stored`), so a refused request leaves no scenario behind."""
        cached = self._scenarios.get(name)
        if cached is not None:
            return cached
        self._check_quarantine(name)
        async with self._scenario_lock:
            cached = self._scenarios.get(name)
            if cached is not None:
                return cached
            found = await asyncio.to_thread(self.store.get_scenario, name)
            if found is None:
                if not self.cfg.server.allow_implicit_scenarios:
                    raise NotFound(f"unknown scenario {name!r}")
                return Scenario(name=name, recipe=self.recipe_for_new_scenario(name), created_at=time.time())
            if found.archived:
                raise NotFound(f"scenario {name!r} was deleted (archived); use another name")
            await asyncio.to_thread(self.learner, found)
            self._scenarios[name] = found
            return found

    def serves_a_seed(self, scenario: Scenario) -> bool:
        """Whether a new scenario of this recipe is served from a creation release its trainer seeds (a harness
        recipe with a trainer), so it must exist before its first request is answered."""
        surface = self.surface_for(scenario)
        return (surface is not None and "harness" in changed_kinds(surface)
                and bool(self.recipe(scenario).config.trainer))

    async def create_scenario(self, name: str) -> Scenario:
        """Store a new scenario (bound to its recipe) and start it. Only for a request that passed every check."""
        await asyncio.to_thread(self.store.get_or_create_scenario, name, self.recipe_for_new_scenario(name))
        return await self.resolve(name)

    def is_active(self, name: str) -> bool:
        """Whether ``name`` is a stored scenario running here (False for a provisional binding)."""
        return name in self._scenarios

    def _check_quarantine(self, name: str) -> None:
        reason = self._quarantined.get(name)
        if reason is not None:
            raise ScenarioQuarantined(f"scenario {name!r} is quarantined: {reason}", scenario=name)

    def quarantine(self, name: str, exc: BaseException) -> None:
        """Take one scenario out of service (logged, listed in status) so the others keep serving."""
        reason = exc.message if isinstance(exc, ReefError) else f"{type(exc).__name__}: {exc}"
        self._quarantined[name] = reason
        log.error("scenario %r quarantined: %s", name, reason, exc_info=not isinstance(exc, ReefError))

    def report_schema(self, scenario: Scenario):
        """The recipe's report validator for this scenario, or None."""
        name = self.recipe(scenario).config.report_schema
        if not name:
            return None
        if name not in self._report_schemas:
            self._report_schemas[name] = self.pm.create("report_schema", name)
        return self._report_schemas[name]

    def report_key(self, scenario: Scenario, report: dict) -> str | None:
        """The key ``report`` must hold alone among the scenario's stored reports, by its processor's door rule
        (:meth:`~reef_core.observe.processor.Processor.report_key`); raises ``ValidationFailed`` for a report the
        processor refuses. Never blocks: the learner of a stored scenario exists once :meth:`resolve` returned; a
        scenario not stored yet has no processor, so its first report meets only the store's checks."""
        learner = self._learners.get(scenario.name)
        # A follower's processor never ingests: it only applies the same door rule as the learner's would.
        processor = getattr(learner, "processor", None) or getattr(learner, "door", None)
        return processor.report_key(report) if processor is not None else None

    # -- the loop ------------------------------------------------------------------------------

    def surface(self, name: str | None, options: dict | None = None):
        """The surface component ``name`` built with ``options`` (one instance per name and options), or None.

        A ``weights`` surface holds the engine's one set of weights: a second one would swap them behind the
        first one's back, so recipes naming it with different options are refused."""
        if not name:
            return None
        options = dict(options or {})
        key = (name, json.dumps(options, sort_keys=True, default=str))
        found = self._surfaces.get(key)
        if found is None:
            found = self.pm.create("surface", name, ports=self.serving_ports, options=options)
            if getattr(found, "kind", None) == "weights":
                other = next(((k, s) for k, s in self._surfaces.items() if getattr(s, "kind", None) == "weights"),
                             None)
                if other is not None:
                    raise ConfigError(
                        f"recipes use the weights surface {name!r} with surface_options {options} and "
                        f"{other[0][0]!r} with {json.loads(other[0][1])}; the engine holds one set of weights, "
                        f"so every recipe serving it must name the same weights surface with the same options")
            self._surfaces[key] = found
        return found

    def recipe_surface(self, config, where: str = ""):
        """The surface a recipe names: ``recipe.surface``, or a composite of ``recipe.surfaces`` (one per recipe
        settings; its parts are the shared surfaces :meth:`surface` builds)."""
        if not config.surfaces:
            if config.changes and list(config.changes) != [config.surface]:
                raise ConfigError(f"{where}recipe.changes: names surfaces of recipe.surfaces; with recipe.surface "
                                  f"{config.surface!r} it is [{config.surface}] or unset")
            return self.surface(config.surface, config.surface_options)
        key = json.dumps([config.surfaces, config.changes, config.surface_options], sort_keys=True, default=str)
        found = self._composites.get(key)
        if found is None:
            names, changes, options = composite_parts(config, where)
            found = CompositeSurface({n: self.surface(n, options[n]) for n in names}, changes, self.artifacts)
            self._composites[key] = found
        return found

    def surface_for(self, scenario: Scenario):
        """The surface of the scenario's recipe."""
        return self.recipe_surface(self.recipe(scenario).config)

    def settings_for(self, scenario: Scenario) -> LearnerSettings:
        """The learner settings of the scenario's recipe (its trainer and evaluation sections)."""
        return self._settings[self.recipe(scenario).name]

    def learner(self, scenario: Scenario):
        """The scenario's learner (created, recovered and started on first use), or its follower where this
        process does not train it (see the module doc). A scenario whose learner cannot start is quarantined
        (:class:`ScenarioQuarantined`, 503) instead of failing the caller's whole process. In the ``learn`` role,
        None while another process holds the scenario's lease."""
        with self._learners_lock:
            found = self._learners.get(scenario.name)
            if found is None:
                self._check_quarantine(scenario.name)
                if self.role == "serve":
                    return self._follow(scenario)
                self._hold_writer_lock()  # not one scenario's fault: a second server on this data dir fails here
                if self._leases is not None and not self._leases.try_acquire(scenario.name):
                    if self.role == "learn":
                        return None  # a standby: retried by the learn loop, which takes over when the lease frees
                    log.warning("scenario %r: another process runs its learner; this one serves it as a follower",
                                scenario.name)
                    return self._follow(scenario)
                found = self._start_learner(scenario)
            return found

    def _start_learner(self, scenario: Scenario):
        """Build, recover and start the scenario's learner (its lease, if any, held); quarantine it if it cannot."""
        from .learner import ScenarioLearner

        with self._learners_lock:
            try:
                found = ScenarioLearner(scenario.name, self.recipe(scenario).config, self.surface_for(scenario),
                                        self.learner_ports, self.settings_for(scenario))
                try:
                    found.start()  # recovery runs here, before the scenario serves
                except BaseException:
                    found.stop()  # no turns for a learner that did not start
                    raise
            except Exception as exc:  # noqa: BLE001 - one scenario's data must not stop the others
                if self._leases is not None:
                    self._leases.release(scenario.name)
                self.quarantine(scenario.name, exc)
                raise ScenarioQuarantined(f"scenario {scenario.name!r} is quarantined: "
                                          f"{self._quarantined[scenario.name]}", scenario=scenario.name) from exc
            self._learners[scenario.name] = found
            return found

    def _serve_round(self) -> None:
        """Each watcher round of a ``reef serve`` on PostgreSQL: wake the learners held here (records also arrive
        through other processes) and take over a followed scenario whose lease freed (its learner's process
        ended)."""
        from .learner import ScenarioLearner

        for name, found in list(self._learners.items()):
            if isinstance(found, ScenarioLearner):
                if found.processor is not None:
                    found.wake()
                continue
            with self._learners_lock:
                if self._learners.get(name) is not found or not self._leases.try_acquire(name):
                    continue
                scenario = self._scenarios.get(name) or self.store.get_scenario(name)
                try:
                    self._start_learner(scenario)
                    log.warning("scenario %r: its learner's process is gone; the learner runs here now", name)
                except ScenarioQuarantined:
                    pass  # the follower keeps serving; status shows the reason

    def _hold_writer_lock(self) -> None:
        """One process writes this data directory's commit logs (taken once, before any learner); with a
        PostgreSQL store, also open this process's lease session."""
        with self._learners_lock:
            if self._writer_lock is None:
                self._writer_lock = WriterLock(self.learner_settings.commits_dir)
            if self.shared and self._leases is None:
                self._leases = LeaseHolder(self.store.sql_engine, self.store.schema)

    def _shared_log(self, scenario: str) -> PgCommitLog:
        """The scenario's commit log in PostgreSQL; a file log this data directory kept before (a deployment
        that moved its records to PostgreSQL earlier) is copied in first, so its steps and consumed ids carry
        over."""
        fence = self._leases.fence(scenario) if self._leases is not None else None
        shared = PgCommitLog(self.store.sql_engine, scenario, self.learner_settings.commits_dir, fence=fence)
        if scenario_path(self.learner_settings.commits_dir, scenario, ".jsonl").exists():
            copied = shared.adopt(CommitLog.for_scenario(self.learner_settings.commits_dir, scenario, writer=False))
            if copied:
                log.warning("scenario %r: %d commit-log rows copied from %s into PostgreSQL", scenario, copied,
                            shared.path)
        return shared

    def _follow(self, scenario: Scenario) -> ScenarioFollower:
        """A follower of the scenario's head (called with the learners' lock held)."""
        log_view = (PgCommitLog(self.store.sql_engine, scenario.name, self.learner_settings.commits_dir,
                                writer=False) if self.shared else None)
        recipe = self.recipe(scenario).config
        follower = ScenarioFollower(scenario.name, recipe, self.surface_for(scenario), self.artifacts, log_view)
        if recipe.processor:
            follower.door = self.pm.create(
                "processor", recipe.processor, scenario=scenario.name, options=dict(recipe.processor_options),
                serving_version=follower.serving_version,
                load_records=functools.partial(self.store.get_many, scenario.name), create=self.pm.create,
                engine=self.engine, run_async=self.run_async)
        follower.start()
        self._learners[scenario.name] = follower
        self._watch()
        return follower

    def _watch(self) -> None:
        """Start the head watcher (once): followers' refreshes, and :meth:`_serve_round` in a ``reef serve``."""
        with self._learners_lock:
            if self._watcher is None:
                on_round = self._serve_round if self.role == "all" and self.shared else None
                self._watcher = HeadWatcher(self._followers, self.cfg.server.follow_interval_s,
                                            dsn=psycopg_dsn(self.store.sql_engine) if self.shared else None,
                                            channel=head_channel(self.store.schema), on_round=on_round)
                self._watcher.start()

    def learners(self) -> dict[str, Any]:
        """The learners (and followers) held in this process, by scenario name (a snapshot)."""
        return dict(self._learners)

    def _followers(self) -> dict[str, ScenarioFollower]:
        return {name: found for name, found in list(self._learners.items()) if isinstance(found, ScenarioFollower)}

    def _notify(self, hook_name: str, **kwargs) -> None:
        """Lifecycle hooks for plugins; a head move also reaches the replicas listening on PostgreSQL."""
        self.pm.notify(hook_name, **kwargs)
        if self.tracing is not None:
            self.tracing.notify(hook_name, **kwargs)
        if hook_name == "reef_release_published":
            if self.shared:
                notify_head_moved(self.store.sql_engine, self.store.schema, kwargs["scenario"])
            if self.tell_workers is not None:
                self.tell_workers({"head": kwargs["scenario"]})

    def records_arrived(self, scenario: str) -> None:
        """Another process on this record store (a worker) stored records of ``scenario``: wake its learner."""
        learner = self._learners.get(scenario)
        if learner is not None and learner.processor is not None:
            learner.wake()

    def follow_head(self, scenario: str) -> None:
        """Serve ``scenario``'s head now (its learner's process says it moved), if this process follows it."""
        follower = self._followers().get(scenario)
        if follower is not None:
            follower.refresh()

    def forget_scenario(self, scenario: str) -> None:
        """Another process deleted (archived) ``scenario``: stop serving it here; its next request finds it
        archived."""
        with self._learners_lock:
            found = self._learners.pop(scenario, None)
            self._scenarios.pop(scenario, None)
        if found is not None:
            found.stop()

    def learn_round(self) -> list[str]:
        """One round of the ``learn`` role: take over every free scenario and wake every learner held here (records
        arrive through other processes). Returns the scenarios this process trains. Raises
        ``StorageUnavailable`` once the lease session is lost: the process must stop training."""
        from ..errors import StorageUnavailable

        if self._leases is not None and not self._leases.alive():
            raise StorageUnavailable("the learner's lease session to PostgreSQL was lost; stopping")
        for scenario in self.store.scenarios():
            if scenario.archived or scenario.name in self._learners:
                continue
            try:
                if self.learner(scenario) is not None:
                    self._scenarios[scenario.name] = scenario
                    log.info("scenario %r: learner active in this process", scenario.name)
            except ScenarioQuarantined:
                pass
        for learner in list(self._learners.values()):
            learner.wake()
        return sorted(self._learners)

    async def record_stored(self, record, idempotency_key: str | None = None, *,
                            check_references: bool = False):
        """Store ``record`` durably, tell the plugins, and wake the scenario's learner (never waits for
        training). The one path every record takes into the loop; returns the stored record.

        A caller cancelled meanwhile (its client went away) changes nothing: the write is queued at once, and
        plugins and learner hear of the record when it is durable, whether or not anyone still waits for it.
        The first record of a new scenario creates its row in the same transaction (its learner starts once the
        record is durable, before a caller still waiting returns), so only a stored record creates a scenario."""
        new_recipe = None if record.scenario in self._scenarios else self.recipe_for_new_scenario(record.scenario)
        durable = self.store.submit(record, idempotency_key, check_references=check_references,
                                    new_scenario_recipe=new_recipe)
        durable.add_done_callback(self._announce)
        stored = (await asyncio.shield(durable))[0]
        if stored.scenario not in self._scenarios:  # a caller still waiting sees the new scenario running
            await self._start_new_scenario(stored.scenario, stored.record_id)
        return stored

    async def records_stored(self, records: list, *, check_references: bool = True) -> list:
        """:meth:`record_stored` for a group of one scenario's records, stored in one transaction or not at all
        (record import). Returns the stored records in input order."""
        if not records:
            return []
        scenario = records[0].scenario
        new_recipe = None if scenario in self._scenarios else self.recipe_for_new_scenario(scenario)
        durable = self.store.submit_many(records, check_references=check_references, new_scenario_recipe=new_recipe)
        durable.add_done_callback(self._announce)
        stored = await asyncio.shield(durable)
        if scenario not in self._scenarios:
            await self._start_new_scenario(scenario, stored[0].record_id)
        return stored

    async def _start_new_scenario(self, name: str, record_id: str) -> None:
        try:
            await self.resolve(name)  # starts the learner, which reads the new record from the store
        except ReefError as exc:  # the record is durable and its receipt goes out regardless
            log.error("scenario %r: record %s stored, but the scenario cannot run: %s", name, record_id, exc.message)

    def _announce(self, durable: asyncio.Future) -> None:
        if durable.cancelled() or durable.exception() is not None:
            return  # the waiter gets the error, if one still waits
        records = durable.result()
        if records and self.on_records is not None:
            self.on_records(records[0].scenario)
        if records and records[0].scenario not in self._scenarios:
            asyncio.get_running_loop().create_task(self._start_new_scenario(records[0].scenario,
                                                                            records[0].record_id))
        for stored in records:
            self._announce_one(stored)

    def _announce_one(self, stored) -> None:
        self._notify("reef_record_stored", record=stored)
        if stored.kind == "report":
            self._notify("reef_report_accepted", record=stored, references=list(stored.references))
        learner = self._learners.get(stored.scenario)
        if learner is not None:
            if stored.version is not None:
                learner.served(stored.version)
            if learner.processor is not None:  # without one the learner has nothing to ingest: spare the wake-up
                learner.wake()

    def load_base_model(self):
        """The deployment's base model, as the local engine loaded it (``(model, tokenizer)``)."""
        from ..models.loading import load_model, model_cache_dir, resolve_model

        engine_cfg = self.cfg.engine
        return load_model(resolve_model(engine_cfg.model, self.data_dir, model_cache_dir(engine_cfg)))

    def run_async(self, coroutine, timeout: float | None = 600):
        """Run a coroutine on the server's event loop from a worker thread and wait for it."""
        if self._loop is None:
            return asyncio.run(coroutine)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def release_rows(self, scenario: str) -> list[dict]:
        return self._learners[scenario].release_rows() if scenario in self._learners else [
            r.to_dict() for r in self.artifacts.releases(scenario)]

    def evaluation_runs(self, scenario: str, limit: int) -> list[dict]:
        """The scenario's ``reef eval releases`` results under the data directory, newest first."""
        from .eval_results import load_runs

        return load_runs(self.data_dir, scenario, limit)

    def _scores_by_release(self, scenario: str):
        from .release_compare import scores_by_release, version_table

        rows = self.release_rows(scenario)
        return rows, *scores_by_release(self.store.replay(scenario), version_table(rows))

    def release_scores(self, scenario: Scenario) -> dict:
        """Reported scores per release of ``scenario``, in the order the releases first served (a scan of its
        records: :mod:`reef_core.loop.release_compare`)."""
        _rows, groups, unattributed = self._scores_by_release(scenario.name)
        return {"scenario": scenario.name, "releases": [g.row() for g in groups], "unattributed": unattributed}

    def compare_releases(self, scenario: Scenario, a: str, b: str) -> dict:
        """Scored counts, means and the bootstrap interval of ``b - a`` for two releases of ``scenario`` (ids, or
        alias names); NotFound naming ``a`` or ``b`` for one the scenario does not have."""
        from .release_compare import compare

        rows, groups, _unattributed = self._scores_by_release(scenario.name)
        resolved = [self._release_named(scenario, rows, value, field) for field, value in (("a", a), ("b", b))]
        return {"scenario": scenario.name, **compare(groups, *resolved)}

    def _release_named(self, scenario: Scenario, rows: list[dict], value: str, field: str) -> str:
        """The release id ``value`` (a release id or an alias name) names among the scenario's releases (404
        naming ``field``)."""
        from .aliases import named

        found = named(value, rows, self._aliases_now(scenario.name))
        if found is not None:
            return found
        raise NotFound(f"{field}: scenario {scenario.name!r} has no release or alias {value[:80]!r}", param=field)

    def archive_scenario(self, name: str) -> None:
        learner = self._learners.pop(name, None)
        if learner is not None:
            learner.stop()
        if self.artifacts.head(name) is not None:
            self.artifacts.archive(name)
        self.store.archive_scenario(name)
        self._scenarios.pop(name, None)
        self._quarantined.pop(name, None)
        if self.tell_workers is not None:
            self.tell_workers({"archived": name})

    # -- what serve/ asks (loop/ports.py: ServePorts) -------------------------------------------

    @property
    def server(self):
        return self.cfg.server

    def find_scenario(self, name: str) -> Scenario | None:
        return self.store.get_scenario(name)

    def list_scenarios(self) -> list[Scenario]:
        return self.store.scenarios()

    def find_record(self, scenario: str, record_id: str):
        return self.store.get(scenario, record_id)

    def find_by_idempotency_key(self, scenario: str, key: str):
        return self.store.find_by_idempotency_key(scenario, key)

    def find_recent_by_request_hash(self, scenario: str, request_hash: str):
        return self.store.find_recent_by_request_hash(scenario, request_hash)

    def records_page(self, scenario: str, after_sequence: int, limit: int) -> list:
        return self.store.page(scenario, after_sequence, limit)

    def last_sequence(self, scenario: str) -> int:
        return self.store.last_sequence(scenario)

    def export_rows(self, scenario: Scenario, fmt: str, **selection) -> Any:
        """``scenario``'s records as an export's rows (:mod:`reef_core.loop.export`), read from the store page by
        page as they are taken; the arguments are checked before this returns."""
        from .export import plan

        return plan(self.store.replay, scenario.name, self.release_rows(scenario.name), fmt, **selection)

    def find_release(self, release_id: str):
        """A release of the chain by id (NotFound for an unknown or malformed id)."""
        return self.artifacts.get(release_id)

    def release_files(self, release_id: str):
        return self.artifacts.read_files(release_id)

    def republish(self, scenario: Scenario, operation: str, release_id: str, note: dict | None = None):
        """Roll ``scenario`` back to, or promote, ``release_id`` (``operation``: ``rollback`` / ``promote``);
        ``note`` (who asked, why) is kept in the new release's source."""
        return self.learner(scenario).republish(operation, release_id, note)

    # -- aliases (loop/aliases.py) -----------------------------------------------------------------

    def _alias_log(self, required: bool = False):
        make = getattr(self.artifacts, "aliases", None)
        if make is None and required:
            raise Conflict(f"the artifact store {type(self.artifacts).__name__} keeps no aliases")
        return make() if make is not None else None

    def _aliases_now(self, scenario: str) -> dict[str, str]:
        log = self._alias_log()
        return log.current(scenario) if log is not None else {}

    def list_aliases(self, scenario: Scenario) -> dict:
        """``production`` (the release serving now) and every other alias of ``scenario`` with its last move."""
        from . import aliases

        rows = self.release_rows(scenario.name)
        out = [found] if (found := aliases.production(rows)) else []
        log = self._alias_log()
        if log is not None:
            last = {}
            for move in log.history(scenario.name, limit=10_000):
                last.setdefault(move["alias"], move)
            for name, release_id in sorted(log.current(scenario.name).items()):
                move = last.get(name, {})
                out.append({"alias": name, "release_id": release_id, "moved_at": move.get("at"),
                            "moved_by": move.get("by"), "reason": move.get("reason")})
        return {"scenario": scenario.name, "aliases": out}

    def move_alias(self, scenario: Scenario, name: str, release_id, reason, by: str) -> dict:
        """Point alias ``name`` at ``release_id`` (checked first: 400/404 naming the field, nothing written).
        ``production`` is served: it moves by a rollback (a promote for a release held for review)."""
        from . import aliases

        aliases.check_name(name)
        reason = aliases.check_reason(reason)
        rows = self.release_rows(scenario.name)
        row = aliases.target(release_id, rows)
        self._ab_arms.pop(scenario.name, None)  # an A/B arm may name this alias
        if name != aliases.PRODUCTION:
            move = self._alias_log(required=True).move(scenario.name, name, row["release_id"], by=by, reason=reason)
            return {"scenario": scenario.name, **move, "moved": move["from"] != move["to"]}
        before = aliases.production(rows)
        if before is not None and before["release_id"] == row["release_id"]:
            return {"scenario": scenario.name, "alias": name, "from": row["release_id"], "to": row["release_id"],
                    "by": by, "reason": reason, "at": None, "moved": False}
        operation = "promote" if row.get("pending") else "rollback"
        release = self.republish(scenario, operation, row["release_id"],
                                 {"alias": name, "by": by, "reason": reason})
        return {"scenario": scenario.name, "alias": name, "from": before["release_id"] if before else None,
                "to": release.release_id, "by": by, "reason": reason, "at": release.created_at,
                "operation": operation, "target_release_id": row["release_id"], "moved": True}

    def alias_history(self, scenario: Scenario, name: str, limit: int) -> dict:
        """The moves of alias ``name``, newest first (``production``'s: the release chain)."""
        from . import aliases

        aliases.check_name(name)
        if name == aliases.PRODUCTION:
            moves = aliases.production_history(self.release_rows(scenario.name), limit)
        else:
            log = self._alias_log()
            moves = log.history(scenario.name, name, limit) if log is not None else []
            if not moves:
                raise NotFound(f"alias: scenario {scenario.name!r} has no alias {name!r}", param="alias")
        return {"scenario": scenario.name, "alias": name, "moves": moves}

    async def evaluate(self, scenario: Scenario, release: str, messages: list, options: dict) -> dict:
        """``messages`` answered by the release ``release`` names (an id, an alias, ``candidate``) on the private
        engine, recording and training nothing (:mod:`reef_core.loop.evaluate`); 404 naming ``release`` for a name
        the scenario does not have, 409 for a release the private engine cannot serve, 429 when it is busy."""
        from .evaluate import generation_of, resolve

        def target():  # git reads, before the evaluator's slot is taken
            row = resolve(release, self.release_rows(scenario.name), self._aliases_now(scenario.name))
            return row, self.artifacts.get(row["release_id"])

        surface = self.surface_for(scenario)
        kind = getattr(surface, "kind", None) or "none"
        row, found = await asyncio.to_thread(target)
        self.evaluator.check(kind)
        generation = generation_of(self.recipe(scenario).evaluation.options.get("generation"), options)
        answer = await self.evaluator.submit(lambda: self.evaluator.answer(
            kind, surface, found, lambda: self.artifacts.read_files(found.release_id), messages, generation))
        answer["reef"] = {"scenario": scenario.name, "release_id": row["release_id"], "release": release,
                          "content_id": row.get("content_id"), "surface": kind, "recorded": False}
        return answer

    # -- rollouts: canary and A/B (loop/rollout.py) ------------------------------------------------

    def rolls_out(self, scenario: Scenario) -> bool:
        """Whether the scenario's recipe assigns requests to releases (``evaluation.rollout`` canary or ab)."""
        return self.recipe(scenario).evaluation.rollout.strategy != "immediate"

    def rollout_plan(self, scenario: Scenario, tags: dict | None, record_id: str) -> tuple[str | None, dict | None]:
        """The release a request is assigned to (None: the head) and what its record keeps (``payload.rollout``),
        by the request's sticky key. Blocking for ``ab`` (its arms are resolved through the release chain and the
        alias log, once per head and alias move)."""
        config = self.recipe(scenario).evaluation.rollout
        key = rollout.sticky_key(tags, record_id, config.sticky)
        if config.strategy == "canary":
            canary = getattr(self._learners.get(scenario.name), "canary", None)
            if canary is None:
                return None, None
            if rollout.in_canary(scenario.name, canary.release_id, key, canary.share):
                return canary.release_id, {"strategy": "canary", "canary": canary.release_id, "arm": rollout.CANARY,
                                           **({} if config.train_canary else {"trains": False})}
            return None, {"strategy": "canary", "canary": canary.release_id, "arm": rollout.PRODUCTION}
        arms = self._resolved_arms(scenario, config.arms)
        arm, release_id = arms[rollout.ab_arm(scenario.name, config.arms, key)]
        info = {"strategy": "ab", "arm": arm, "release_id": release_id}
        if release_id is None:  # the arm names nothing the scenario has (yet): the head serves, the record says so
            return None, {**info, "unresolved": True}
        return (None if release_id == self.serving_version(scenario) else release_id), info

    def _resolved_arms(self, scenario: Scenario, arms: list) -> list[tuple[str, str | None]]:
        from .aliases import named

        head = self.serving_version(scenario)
        cached = self._ab_arms.get(scenario.name)
        if cached is not None and cached[0] == head:
            return cached[1]
        rows, now = self.release_rows(scenario.name), self._aliases_now(scenario.name)
        resolved = [(arm.release, named(arm.release, rows, now)) for arm in arms]
        self._ab_arms[scenario.name] = (head, resolved)
        return resolved

    def canary_state(self, scenario: Scenario) -> dict:
        """The scenario's rollout: the running canary with its scores by arm and the rule's answer, or the A/B arms
        with each one's scored records and mean, and the last canary decision in the chain."""
        config = self.recipe(scenario).evaluation.rollout
        out: dict = {"scenario": scenario.name, "strategy": config.strategy, "canary": None, "test": None,
                     "production_release_id": None, "last_decision": None}
        if not self.is_active(scenario.name):
            return out
        learner = self.learner(scenario)
        if hasattr(learner, "canary_state"):
            out.update(learner.canary_state())
        rows = self.release_rows(scenario.name)
        last = next((row for row in rows if isinstance((row.get("source") or {}).get("canary"), dict)), None)
        if last is not None:
            decision, source = last["source"]["canary"], last["source"]
            out["last_decision"] = {"release_id": last["release_id"], "operation": last.get("operation"),
                                    "at": last.get("created_at"), "canary": decision.get("release_id"),
                                    "decision": decision.get("decision"), "evidence": decision.get("evidence"),
                                    "by": source.get("by"), "reason": source.get("reason")}
        if config.strategy == "ab":
            from .release_compare import scores_by_release, version_table

            groups = {g.release_id: g for g in scores_by_release(self.store.replay(scenario.name),
                                                                   version_table(rows))[0]}
            out["arms"] = []
            for (arm, release_id), spec in zip(self._resolved_arms(scenario, config.arms), config.arms):
                group = groups.get(release_id)
                out["arms"].append({"release": arm, "release_id": release_id, "share": spec.share,
                                    "scored": len(group.scores) if group else 0,
                                    "mean": group.mean if group else None})
        return out

    def decide_canary(self, scenario: Scenario, action, reason, by: str) -> dict:
        """An admin's promote or rollback of the running canary (checked first: 400 naming ``action`` or
        ``reason``, 409 without a canary); the decision release keeps who, why and the evidence so far."""
        from .aliases import check_reason

        if action not in ("promote", "rollback"):
            raise ValidationFailed("action: 'promote' or 'rollback'", param="action")
        reason = check_reason(reason)
        learner = self.learner(scenario) if self.is_active(scenario.name) else None
        if getattr(learner, "canary", None) is None:
            raise Conflict(f"scenario {scenario.name!r} has no canary running")
        canary_id = learner.canary.release_id
        release = learner.conclude_canary(action, by=by, reason=reason)
        return {"scenario": scenario.name, "canary": canary_id, "action": action, "release_id": release.release_id,
                "by": by, "reason": reason, "evidence": (release.source or {}).get("canary", {}).get("evidence")}

    def commit_rows(self, scenario: Scenario, after_step, limit: int, record_id: str | None) -> list[dict]:
        return self.learner(scenario).commit_rows(after_step, limit, record_id)

    def preview_samples(self, scenario: Scenario, limit: int) -> list:
        """What the scenario's processor would train on next (nothing reserved or consumed)."""
        processor = self.learner(scenario).processor
        return processor.preview(limit) if processor is not None else []

    def close_batch(self, scenario: Scenario) -> tuple[int, Any]:
        """Close the scenario's open batch through its newest record now and wake its learner:
        ``(the sequence closed through, what is still waiting)``; Conflict when its processor cannot."""
        learner = self.learner(scenario)
        processor = getattr(learner, "processor", None)
        if processor is None or not callable(getattr(processor, "close_batch", None)):
            raise Conflict(f"the processor of scenario {scenario.name!r} cannot close a batch early")
        through = self.store.last_sequence(scenario.name)
        waiting = processor.close_batch(through)
        learner.wake()
        return through, waiting

    def find_retry(self, scenario: str, request_hash: str, record_id: str, **lookup):
        """:func:`reef_core.loop.inference.find_retry` on this deployment's records (blocking)."""
        return inference.find_retry(self, scenario, request_hash, record_id, **lookup)

    async def plan_inference(self, scenario: Scenario, client_dialect: str, route: str, body: dict,
                             forward_headers: dict[str, str], pin: str | None = None, tags: dict | None = None,
                             record_id: str | None = None):
        """:func:`reef_core.loop.inference.plan`: the engine request for a validated body of ``scenario``; ``pin``:
        the ``x-reef-release`` a request names (an alias or a release id); ``tags`` and ``record_id`` key a rollout's
        sticky assignment."""
        return await inference.plan(self, scenario, client_dialect, route, body, forward_headers,
                                    self.cfg.engine.max_new_tokens, pin=pin, tags=tags, record_id=record_id)

    def pinned_release(self, scenario: Scenario, value: str) -> str | None:
        """The release a request pinning ``value`` is served by, or None for the head (``production``, or the
        alias of the head); 400 naming the header where the surface serves only its head, 404 for a name the
        scenario does not have. Blocking: git reads."""
        from .aliases import PRODUCTION, named, pinnable
        from ..wire import PIN_HEADER

        if value == PRODUCTION:
            return None
        if not self.is_active(scenario.name):
            raise NotFound(f"{PIN_HEADER}: scenario {scenario.name!r} has no release yet", param=PIN_HEADER)
        surface = self.surface_for(scenario)
        if not pinnable(surface):
            kind = getattr(surface, "kind", None) or "no"
            raise ValidationFailed(
                f"{PIN_HEADER}: scenario {scenario.name!r} has {kind} surface, which serves only its head release; "
                "a request can pin releases of a harness surface only (leave the header out)", param=PIN_HEADER)
        rows = self.release_rows(scenario.name)
        found = named(value, rows, self._aliases_now(scenario.name))
        if found is None:
            raise NotFound(f"{PIN_HEADER}: scenario {scenario.name!r} has no release or alias {value[:80]!r}",
                           param=PIN_HEADER)
        return None if found == self.serving_version(scenario) else found

    def harness_adapter(self, name: str):
        """The registered harness adapter ``name`` (UnknownComponent names the registered ones)."""
        return self.pm.create("harness_adapter", name)

    def announce_startup(self) -> None:
        """The ``reef_startup`` hook, once the server is listening."""
        self.pm.notify("reef_startup", config=self.cfg)

    def model_ids(self) -> list[str]:
        return self.engine.model_ids()

    def writer_stats(self):
        """The record writer's counters (None for a store without a writer)."""
        return getattr(self.store, "stats", None)

    def tracing_stats(self) -> dict | None:
        """The OTLP exporter's counters (None with tracing off)."""
        return self.tracing.stats() if self.tracing is not None else None

    def compaction_counts(self) -> dict:
        """Records whose bodies retention compacted, per scenario and reason (``/metrics``)."""
        return self.retention.counts()

    def _retained_scenarios(self) -> list[str]:
        """The scenarios whose learner runs here: the background pass can ask their processors what they hold."""
        return [name for name, held in self.learners().items() if not isinstance(held, ScenarioFollower)]

    def _protected_records(self, scenario: str) -> set[str]:
        """Record ids the scenario's processor holds (pending units, the reserved batch): never compacted."""
        learner = self._learners.get(scenario)
        processor = getattr(learner, "processor", None)
        return set(processor.protected_ids()) if processor is not None else set()

    def plugin_failures(self) -> dict[str, str]:
        return dict(getattr(self.pm, "failures", None) or {})

    def usage_rows(self, periods: list[str]) -> list[tuple[str, str, int, int]]:
        return self.store.usage_rows(periods)

    def add_usage(self, rows: list[tuple[str, str, int, int]]) -> None:
        self.store.add_usage(rows)

    def scenario_view(self, scenario: Scenario):
        """The :class:`~reef_core.loop.ports.ScenarioView` a recipe's route handler reads (starts the learner)."""
        return self.learner(scenario).view()

    def provisional_view(self, name: str):
        """The view of a scenario not stored yet, as its first record would create it (its recipe by the routes),
        built from config alone: no processor, trainer or release, and nothing created. None when no record could
        create it (implicit scenarios are off, or it is archived)."""
        from .ports import ScenarioView

        if not self.cfg.server.allow_implicit_scenarios or self.store.get_scenario(name) is not None:
            return None
        binding = self.recipes.get(self.recipe_for_new_scenario(name))
        if binding is None:
            return None
        return ScenarioView(name=name, recipe=binding.config, processor=None,
                            serving_version=lambda: getattr(self.engine, "version", None), trainer=lambda: None,
                            current_release_id=lambda: None, release_files=lambda _release_id: {})

    def scenario_status(self, scenario: Scenario) -> dict:
        """The learner's status, or the quarantine reason of a scenario that could not start."""
        reason = self._quarantined.get(scenario.name)
        if reason is not None:
            return {"scenario": scenario.name, "recipe": scenario.recipe, "quarantined": reason}
        return self.learner(scenario).status()

    def status(self) -> dict:
        return {"scenarios": {name: learner.status() for name, learner in list(self._learners.items())},
                "quarantined": dict(self._quarantined),
                **({"tracing": self.tracing.stats()} if self.tracing is not None else {}),
                "record_retention": self.retention.status(),
                "engine": {"name": getattr(self.engine, "name", None),
                           "version": getattr(self.engine, "version", None)}}

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.role != "serve":
            await asyncio.to_thread(self._hold_writer_lock)  # a second server on this data dir fails here
        await self.engine.start()
        if self.tracing is not None:
            self.tracing.start()
        self._warm_surfaces()
        # Existing scenarios resume their learners (recovery runs before serving starts). One that cannot is
        # quarantined (see learner()); start-up goes on with the others.
        for scenario in await asyncio.to_thread(self.store.scenarios):
            if not scenario.archived:
                try:
                    if await asyncio.to_thread(self.learner, scenario) is not None:
                        self._scenarios[scenario.name] = scenario
                except ScenarioQuarantined:
                    pass
        if self.role != "serve":  # the pass keeps what this process's processors hold
            await asyncio.to_thread(self.retention.start)
        if self.role == "all" and self.shared:
            # Other processes may serve the same scenarios: wake learners for their records, take over from the dead.
            await asyncio.to_thread(self._hold_writer_lock)
            self._watch()

    def _warm_surfaces(self) -> None:
        """Each surface's :meth:`~reef_core.surfaces.base.Surface.warm` on a daemon thread, once the engine is
        loaded (beside the load it competed with it for a 2-core box's CPU: ready was slower in an A/B run) and never
        awaited: readiness does not wait for it, and a request that needs it meanwhile
        waits only for what is left. A failure is left for that request to raise."""
        surfaces = [s for s in self._surfaces.values() if hasattr(s, "warm")]

        def warm() -> None:
            for surface in surfaces:
                try:
                    surface.warm()
                except Exception:  # noqa: BLE001 - the request path computes it again and reports the error
                    log.debug("surface warm-up failed", exc_info=True)

        if surfaces:
            threading.Thread(target=warm, name="reef-surface-warm", daemon=True).start()

    async def stop(self) -> None:
        for learner in list(self._learners.values()):
            await asyncio.to_thread(learner.stop)
        await asyncio.to_thread(self.pool.close)
        if self.tracing is not None:  # after the learners: their last steps are queued
            await asyncio.to_thread(self.tracing.close)
        await asyncio.to_thread(self.evaluator.close)
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.stop)
        if self._leases is not None:
            self._leases.close()  # ends the session: another process's learner may take over now
            self._leases = None
        await asyncio.to_thread(self.retention.stop)
        try:
            await self.engine.close()
        finally:
            self.store.close()
            if self._writer_lock is not None:
                self._writer_lock.release()
                self._writer_lock = None

    # -- serving version -----------------------------------------------------------------------

    def serving_version(self, scenario: Scenario) -> str | None:
        """The artifact version that serves this scenario's next request."""
        surface = self.surface_for(scenario) if self.is_active(scenario.name) else None
        if surface is not None:
            version = surface.serving_version(scenario.name)
            if version is not None:
                return version
        return getattr(self.engine, "version", None)
