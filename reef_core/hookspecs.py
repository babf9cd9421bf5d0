"""The plugin author's API: every hook a Reef plugin may implement.

A plugin is any module or object whose functions are decorated with ``reef_core.api.hookimpl`` and
whose names match the specs below. ``reef_core.api`` is the only module a plugin imports: the
contracts named here (Processor, Trainer, Surface, Engine, ArtifactStore...) all live there. Installed packages expose plugins through the ``reef``
entry-point group::

    [project.entry-points.reef]
    sao = "reef_sao.plugin"

Reef's own built-in components register through these same hooks (see
``reef_core.plugins.DEFAULT_PLUGINS``), so anything a built-in does a third-party package can do.

Hooks are always called with keyword arguments. Registration hooks receive a ``register``
callable; call it once per component::

    @hookimpl
    def reef_register_processors(register):
        register("per_report", PerReportProcessor, description="one sample per report")

``register(name, factory, *, description="", requires=None)`` records ``factory`` under ``name`` for that
component kind; ``requires`` (``{module: pip requirement}``) names optional dependencies the component
imports when built: a config naming it fails at start-up, naming the requirement, when one is missing. Names are global per kind: two plugins registering the same name is an error
reported at start-up, naming both plugins. Config sections refer to components by these names.
"""

from __future__ import annotations

import pluggy

PROJECT = "reef"

hookspec = pluggy.HookspecMarker(PROJECT)


# ---------------------------------------------------------------------------------------------
# Registration hooks: contribute named components chosen by name in config.
# ---------------------------------------------------------------------------------------------


@hookspec
def reef_register_processors(register):
    """Register processors: turn a scenario's record stream into training batches.

    A processor factory is called as ``factory(scenario=..., options=..., serving_version=...,
    judge=None, load_records=..., create=..., engine=..., run_async=...)`` and should accept further
    keywords (``create(kind, name, **kwargs)`` builds another registered component, e.g. a judge;
    ``engine``/``run_async``: the deployment's served model, for a judge that asks it; ``options``:
    ``recipe.processor_options`` as a plain dict; ``serving_version()`` returns the version now
    serving the scenario; ``judge`` scores next-state pairs; ``load_records(ids)`` reads stored
    records back by id, so a processor holds ids rather than bodies) and returns an object
    implementing ``reef_core.api.Processor``: it ingests every stored
    record of its scenario in order (inference and report), never blocks the request path, and
    exposes ``ready()``, ``pending_batch()`` (the same batch until acknowledged),
    ``acknowledge(batch_id) -> consumed record ids``, ``release(batch_id)`` and ``status()``.
    The learner runs only when a record is stored; a processor whose readiness also changes with
    time (a group timeout, a judge to ask again) says when to look again in ``recheck_after()``.
    """


@hookspec
def reef_register_judges(register):
    """Register next-state judges: what scores a turn from what followed it (computed feedback).

    The factory is called as ``factory(options=<dict>, engine=<Engine | None>, run_async=<RunAsync | None>)``
    (``engine`` and ``run_async``: the deployment's, for a judge that asks the served model) and returns a callable
    ``judge(turn=<dict>, next_state=<dict>) -> {"score": float, "hints": [str, ...]}``; ``turn`` is
    ``{"messages", "reply", "agent_record_id", "tags"}`` and ``next_state`` ``{"role": "user" | "tool",
    "content"}``. It runs on a learner thread, never on the request path, and may be slow (a reward model);
    an optional ``status()`` returns its counters (calls, seconds). Recipes that learn from the next state
    (``reef-openclaw``) pick one by name; a processor factory builds it through its ``create`` keyword.
    """


@hookspec
def reef_register_trainers(register):
    """Register trainers: turn a ready batch into a candidate update.

    The factory is called as ``factory(scenario=..., recipe=<RecipeConfig>, trainer=<TrainerConfig>,
    context=<TrainerSetup>)`` (all three in ``reef_core.api``; ``recipe.options`` is a plain dict the
    trainer validates) and returns a ``reef_core.api.Trainer``. Weight recipes usually return a
    ``reef_core.api.TorchTrainer`` running their objective (a loss over token-level
    samples with rollout log-probs and masks); harness recipes return a trainer whose candidates
    are new text trees.
    """


@hookspec
def reef_register_evaluators(register):
    """Register evaluators: ``evaluate(candidate) -> EvaluationResult``.

    The factory is called as ``factory(tasks=<list of task dicts>, run=<callable(subject, task)>,
    options=<dict>)``. Evaluation is the first half of the gate; it must be idempotent per
    candidate id. Built-ins:
    ``exact_match``, ``regex``, ``json_schema``, ``python`` (a verifier named by dotted path) and
    ``replay`` (the processor's held-out records: the candidate answers them, the scorer named by
    ``options["scorer"]`` judges the replies, their reported scores are the baseline). The learner
    passes ``evaluation.tasks`` when set (else the trainer's ``eval_tasks``; the held-out records for
    ``replay``). ``evaluation.evaluator`` names one, or is an explicit ``package.module:factory`` path
    called the same way.
    """


@hookspec
def reef_register_selection_policies(register):
    """Register selection policies: ``decide(candidate, evaluation) -> Decision``.

    The factory takes the policy's options as keyword arguments (``evaluation.options.policy``).
    The second half of the gate: ``select`` or ``reject`` with a reason. Exceptions reject
    (fail closed). Built-ins: ``always``, ``score_comparison``, ``paired_confidence``, ``floor``.
    ``evaluation.policy`` names the selection policy, or is an explicit ``package.module:Name`` path
    (a class or factory taking the same options, or an object with ``decide``).
    """


@hookspec
def reef_register_artifact_stores(register):
    """Register artifact stores: where releases live (the built-in is ``git``, git + git-lfs).

    The factory is called as ``factory(config=<storage section>, data_dir=<Path>)`` and returns a
    ``reef_core.api.ArtifactStore``; the committer, recovery and ``reef gc`` use nothing else.
    """


@hookspec
def reef_register_surfaces(register):
    """Register surfaces: how a published release reaches live requests.

    The factory is called once per distinct ``recipe.surface_options`` of the recipes naming it (a
    ``weights`` surface: once per deployment) as ``factory(ports=<ServingPorts>, options=<dict>)``
    and returns a ``reef_core.api.Surface``. ``ports`` (``reef_core.api.ServingPorts``) holds
    what a surface may use: ``engine``, ``artifacts``, ``run_async(coroutine)`` (run on the
    server's event loop from a learner worker) and ``load_base_model()``. A surface validates a
    candidate before publication (``validate(files)``, and ``validate_successor(files, previous)`` against the
    serving release: a refusal rejects the candidate), says what
    a new scenario's first release holds when its trainer seeds none (``creation_files()``; the
    weights surface: ``base.json`` naming the base model), loads it into the runtime (weights), rewrites requests (inject an adapter or a
    system prompt or a skill catalog) and exposes a text tree (harness). Built-ins: ``weights``, ``harness``,
    ``skills`` (a harness surface whose releases are skill pools; see ``reef_core.surfaces.skills``).
    """


@hookspec
def reef_register_engines(register):
    """Register inference engines (``engine.kind`` in config).

    The factory is called as ``factory(config=<engine section>, data_dir=<Path>)`` and returns a
    ``reef_core.api.Engine``. Built-ins: ``upstream`` (any OpenAI- or
    Anthropic-compatible endpoint) and ``local`` (an embedded transformers model).
    """


@hookspec
def reef_register_report_schemas(register):
    """Register typed report schemas, validated at the door of ``POST /reef/report``.

    The factory returns a callable ``validate(report: dict) -> dict`` that raises
    ``reef_core.errors.ValidationFailed`` with a clear message for a report that does not fit.
    A recipe names its schema in ``recipe.report_schema``.
    """


@hookspec
def reef_register_tasks(register):
    """Register offline tasks run by ``reef sweep`` jobs (``task=<name>`` in config).

    The factory is called as ``factory(cfg=<ReefConfig>, output_dir=<Path>)`` (the composed config as
    plain dataclasses, see ``reef_core.config.schema``) and returns
    a JSON-serialisable summary. The built-in ``dry_run`` validates the job's config and writes it;
    ``learn`` runs the recipe's learning loop offline on a task file and writes ``metrics.json``, which
    ``reef sweep`` gathers into a summary table after a multirun.
    """


@hookspec
def reef_register_scenario_routes(register):
    """Register a recipe's read routes under a scenario: ``GET /reef/scenarios/{scenario}/<name>``.

    ``name`` is ``<recipe>/<path>`` (lower-case letters, digits, ``-`` and ``_``, segments joined by ``/``), e.g.
    ``register("ttt/plan", handler)`` serves ``GET /reef/scenarios/{scenario}/ttt/plan``. The route answers only
    for scenarios bound to that recipe. ``handler(view, query)`` runs on a worker thread and returns a
    JSON-serialisable dict (the 200 body); ``view`` is a ``reef_core.api.ScenarioView`` (the scenario's name,
    recipe section, processor, serving version, trainer and serving release files), ``query`` the query
    parameters as a dict of strings. The core checks the scenario first and creates nothing: 400 for a name the
    scenario rule refuses, 404 for an archived scenario or one of another recipe, 503 for a quarantined one. A name
    not stored yet whose first record would bind it to the recipe gets a view with no processor, trainer or release
    (``view.processor is None``): the handler answers from ``view.recipe`` alone; otherwise it is a 404. The
    handler checks its own query parameters and raises ``ValidationFailed`` (400, naming the parameter),
    ``NotFound`` or another ``ReefError``; it must not change the scenario. Routes exist in every deployment that
    loads the plugin (``/openapi.json`` lists them), so the fuzz test covers them.
    """


@hookspec
def reef_register_harness_adapters(register):
    """Register harness adapters: how a harness tree installs for one agent CLI.

    The factory is called with no arguments and returns a ``reef_core.api.HarnessAdapter``: its ``binary`` (the
    agent program the ``reef-<name>`` wrapper runs; None runs the command line given), ``environment`` (variables
    the wrapper exports, ``{dir}`` standing for the install directory) and ``render(files, binding)`` (the files to
    install: the tree's own plus the agent's config, pointed at Reef through ``binding``, a
    ``reef_core.api.ModelBinding``). ``GET /reef/harness/install?adapter=<name>`` bakes them into its script.
    Built-ins: ``generic`` and ``opencode``.
    """


@hookspec
def reef_config_searchpath():
    """Return Hydra config search path entries (e.g. ``"pkg://reef_sao.conf"``), or a list of them.

    A recipe package ships its config group file ``conf/recipe/<name>.yaml`` inside its import
    package and returns ``"pkg://<package>.conf"`` here, so ``+recipe=<name>`` finds it however
    the package was installed (wheel, editable, zip).
    """


# ---------------------------------------------------------------------------------------------
# Lifecycle hooks: observe the loop. Implementations must be quick and must not raise; an
# exception is logged and ignored so one plugin cannot break serving.
# ---------------------------------------------------------------------------------------------


@hookspec
def reef_startup(config):
    """Called once when ``reef serve`` has composed its config (a ``ReefConfig``), before the server binds."""


@hookspec
def reef_record_stored(record):
    """Called after a record (inference or report) is durably stored. ``record`` is a ``Record``."""


@hookspec
def reef_report_accepted(record, references):
    """Called after a report is stored; ``references`` are the inference records it quotes."""


@hookspec
def reef_release_published(scenario, release):
    """Called after a release became a scenario's head (training, rollback or promote)."""


@hookspec
def reef_step_committed(scenario, row):
    """Called after a learner step's commit-log row is durable, whatever the gate decided (selected, rejected, held
    for review, or a batch the trainer refused). ``row`` is that row: ``step``, ``consumed_ids`` (the batch),
    ``decision``, ``metrics``, ``release_id`` (or ``live_release_id``), ``recorded_at``. Runs on a learner thread."""
