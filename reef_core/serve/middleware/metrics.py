"""``GET /metrics``: the deployment in Prometheus text format (prometheus-client).

Two kinds of series:

* **Per request**, counted by :class:`~reef_core.serve.middleware.observe.ObserveMiddleware` as each response ends:
  requests by route, dialect, status and scenario, the latency Reef adds and the upstream engine's latency
  (histograms by route: buckets times scenarios would make a scrape slow) and tokens in and out by scenario. These are the only series touched on the inference path (a few label lookups and
  increments per request).
* **Read at scrape time** by :class:`DeploymentCollector`: the record writer (queue depth, batches, commit
  time), each learner's counters (steps, selected, rejected), the samples it dropped by reason
  (``reef_samples_dropped_total{scenario,reason}``), its last reward, loss and policy lag, its last publish latency,
  and plugin load failures. Nothing is maintained for them between scrapes.

Cardinality is bounded: the ``route`` label is a route template (never a path with ids in it), ``status`` a
number, and ``scenario`` one of the first ``server.metrics_max_scenarios`` names seen; later scenarios share
the label ``_other``.
"""

from __future__ import annotations

import threading

from fastapi import APIRouter, Request
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString
from starlette.responses import Response

from reef_core.errors import ConfigError, ValidationFailed

# ``*_created`` series double every counter's lines (a scrape's cost) and tell a scraper nothing it lacks.
disable_created_metrics()

#: The scenario label of every scenario past the cap.
OVERFLOW = "_other"
#: The scenario label of a request that names none (or was refused before naming one).
NO_SCENARIO = ""

# Reef's own cost is a millisecond or less; an upstream model call is seconds.
_ADDED_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_UPSTREAM_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


#: Families a worker process (``server.workers``) reports to its primary, whose scrape shows their sums over the
#: processes: the per-request series and the record writer's counters (each process writes its own records).
SUMMED = frozenset({"reef_requests", "reef_added_latency_seconds", "reef_upstream_latency_seconds", "reef_tokens",
                    "reef_record_writer_batches", "reef_record_writer_appends", "reef_record_writer_commit_seconds",
                    "reef_record_writer_failed_requests", "reef_record_writer_queue_depth",
                    "reef_tracing_spans_exported", "reef_tracing_spans_dropped", "reef_tracing_spans_sampled_out",
                    "reef_tracing_export_failures", "reef_tracing_queue_depth"})
#: Of those, the ones that are not counters: a worker gone takes its value with it.
_GAUGES = frozenset({"reef_record_writer_queue_depth", "reef_tracing_queue_depth"})


class WorkerSeries:
    """The primary's copy of what its workers counted: each worker's latest report, plus the counts of workers
    that exited (so that a sum never goes down when a worker is started again)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[int, dict[str, dict[tuple, float]]] = {}
        self._retired: dict[str, dict[tuple, float]] = {}

    def report(self, worker: int, families: dict) -> None:
        """Take a worker's report: ``{family: [[sample name, {label: value}, value], ...]}``."""
        parsed = {family: {(name, tuple(sorted(labels.items()))): float(value) for name, labels, value in samples}
                  for family, samples in families.items() if family in SUMMED}
        with self._lock:
            self._latest[worker] = parsed

    def retire(self, worker: int) -> None:
        """A worker exited: keep its counters' last values."""
        with self._lock:
            gone = self._latest.pop(worker, {})
            for family, samples in gone.items():
                if family in _GAUGES:
                    continue
                kept = self._retired.setdefault(family, {})
                for key, value in samples.items():
                    kept[key] = kept.get(key, 0.0) + value

    def merged(self, family: str, samples: list) -> list:
        """``family``'s samples of this process plus the workers'; a label set only a worker has is appended."""
        with self._lock:
            extra = [self._retired.get(family, {})] + [latest.get(family, {}) for latest in self._latest.values()]
        if not any(extra):
            return samples
        sums: dict[tuple, list] = {(s.name, tuple(sorted(s.labels.items()))): [s, s.value] for s in samples}
        for part in extra:
            for key, value in part.items():
                found = sums.get(key)
                if found is None:
                    sums[key] = [Sample(key[0], dict(key[1]), 0.0), value]
                else:
                    found[1] += value
        return [sample._replace(value=value) for sample, value in sums.values()]


def worker_report(registry: CollectorRegistry) -> dict:
    """What a worker sends its primary: its :data:`SUMMED` families' samples."""
    return {family.name: [[sample.name, sample.labels, sample.value] for sample in family.samples]
            for family in registry.collect() if family.name in SUMMED}


class ScenarioLabels:
    """The first ``cap`` scenario names keep their own label; any later one maps to :data:`OVERFLOW`."""

    def __init__(self, cap: int):
        self.cap = cap
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, scenario: str | None) -> str:
        if not scenario:
            return NO_SCENARIO
        if scenario in self._named:
            return scenario
        with self._lock:
            if len(self._named) < self.cap:
                self._named.add(scenario)
                return scenario
        return OVERFLOW


class ServeMetrics:
    """The per-request series of one app (a registry of its own: two apps in one process never mix)."""

    def __init__(self, deployment, max_scenarios: int):
        if not isinstance(max_scenarios, int) or isinstance(max_scenarios, bool) or max_scenarios < 1:
            raise ConfigError(f"server.metrics_max_scenarios must be a positive integer (got {max_scenarios!r})")
        self.registry = CollectorRegistry(auto_describe=False)
        self._children: dict[tuple, object] = {}  # see _child
        self.scenario_label = ScenarioLabels(max_scenarios)
        labels = ("route", "dialect", "status", "scenario")
        self.requests = Counter("reef_requests", "HTTP requests answered", labels, registry=self.registry)
        self.added = Histogram("reef_added_latency_seconds", "Time Reef adds to an inference request (total "
                               "minus upstream)", ("route",), buckets=_ADDED_BUCKETS,
                               registry=self.registry)
        self.upstream = Histogram("reef_upstream_latency_seconds", "Time the engine took to answer",
                                  ("route",), buckets=_UPSTREAM_BUCKETS, registry=self.registry)
        self.tokens = Counter("reef_tokens", "Tokens in (prompt) and out (completion) of inference requests",
                              ("direction", "scenario"), registry=self.registry)
        self.registry.register(DeploymentCollector(deployment, self.scenario_label))
        #: In a primary with workers (``server.workers``): their series, summed into each scrape.
        self.workers: WorkerSeries | None = None

    def observe(self, route: str, dialect: str, status: int, seconds: float, facts: dict | None) -> None:
        """Count one answered request; ``facts`` is what the inference call left in the request state."""
        scenario = self.scenario_label(facts.get("scenario") if facts else None)
        self._child(self.requests, route, dialect, status, scenario).inc()
        if not facts or "engine_ms" not in facts:
            return
        engine_s = facts["engine_ms"] / 1000
        self._child(self.upstream, route).observe(engine_s)
        self._child(self.added, route).observe(max(seconds - engine_s, 0.0))
        if facts.get("tokens_in"):
            self._child(self.tokens, "in", scenario).inc(facts["tokens_in"])
        if facts.get("tokens_out"):
            self._child(self.tokens, "out", scenario).inc(facts["tokens_out"])

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, remembered: the library's look-up (a lock, string conversion, a tuple) runs
        once per label set instead of on every request. Label sets are bounded as the series are (the scenario
        label is capped); series are never removed, so a remembered child stays the one a scrape reads."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*(str(label) for label in labels))
        return child

    def render(self) -> bytes:
        return render_text(self.registry, self.workers)


def render_text(registry: CollectorRegistry, workers: WorkerSeries | None = None) -> bytes:
    """The Prometheus text format of ``registry``, as ``generate_latest`` writes it for the series Reef has
    (counters, gauges, histograms; label names fixed here, so only values need escaping), at a third of its
    cost: a scrape of 100 scenarios is about a thousand lines. ``workers``: their series added in."""
    out: list[str] = []
    for family in registry.collect():
        if workers is not None and family.name in SUMMED:
            family.samples = workers.merged(family.name, family.samples)
        name, kind = family.name, family.type
        if kind == "counter":
            name += "_total"
        elif kind not in ("gauge", "histogram"):  # not produced by Reef: the library's own writer
            return generate_latest(registry)
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
        for sample in family.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
                out.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n")
            else:
                out.append(f"{sample.name} {floatToGoString(sample.value)}\n")
    return "".join(out).encode()


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return value


class DeploymentCollector:
    """Series read from the deployment at scrape time (see the module docstring)."""

    def __init__(self, deployment, scenario_label: ScenarioLabels):
        self.dep = deployment
        self.scenario_label = scenario_label

    def collect(self):
        yield from self._writer()
        yield from self._tracing()
        yield from self._learners()
        yield _compacted_family(self.dep.compaction_counts(), self.scenario_label)
        failures = self.dep.plugin_failures()
        yield GaugeMetricFamily("reef_plugin_load_failures", "Plugins that failed to load at startup",
                                value=len(failures))

    def _writer(self):
        stats = self.dep.writer_stats()
        if stats is None:
            return
        yield GaugeMetricFamily("reef_record_writer_queue_depth", "Writes queued for the record writer",
                                value=stats.pending)
        yield CounterMetricFamily("reef_record_writer_batches", "Append batches attempted", value=stats.batches)
        yield CounterMetricFamily("reef_record_writer_appends", "Append requests committed in batches "
                                  "(divided by batches: the mean batch size)", value=stats.appended)
        yield CounterMetricFamily("reef_record_writer_commit_seconds", "Seconds spent committing append batches "
                                  "(divided by batches: the mean commit latency)", value=stats.commit_s)
        yield GaugeMetricFamily("reef_record_writer_largest_batch", "Most append requests in one transaction",
                                value=stats.largest_batch)
        yield CounterMetricFamily("reef_record_writer_failed_requests", "Writes whose caller got a storage error",
                                  value=stats.failed_requests)

    def _tracing(self):
        """The OTLP exporter (``observability.tracing``): spans sent, dropped by reason, sampled out, failed exports."""
        stats = self.dep.tracing_stats()
        if stats is None:
            return
        yield CounterMetricFamily("reef_tracing_spans_exported", "Spans the collector accepted",
                                  value=stats["exported"])
        dropped = CounterMetricFamily("reef_tracing_spans_dropped", "Spans lost, by reason (queue_full, "
                                      "export_failed, unencodable, shutdown)", labels=["reason"])
        for reason, count in sorted(stats["dropped"].items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield CounterMetricFamily("reef_tracing_spans_sampled_out", "Traces left out by observability.tracing.sample",
                                  value=stats["sampled_out"])
        yield CounterMetricFamily("reef_tracing_export_failures", "Exports that failed or timed out",
                                  value=stats["export_failures"])
        yield GaugeMetricFamily("reef_tracing_queue_depth", "Spans waiting for the exporter",
                                value=stats["queue_depth"])

    def _learners(self):
        counters = {name: CounterMetricFamily(f"reef_learner_{name}", help_, labels=["scenario"])
                    for name, help_ in (("steps", "Training steps taken"),
                                        ("selected", "Candidates the gate selected"),
                                        ("rejected", "Candidates the gate rejected"))}
        gauges = {name: GaugeMetricFamily(f"reef_learner_{name}", help_, labels=["scenario"])
                  for name, help_ in (("reward", "Mean reward of the last training step"),
                                      ("loss", "Loss of the last training step"),
                                      ("policy_lag", "Mean policy lag of the last training step"),
                                      ("publish_latency_seconds", "Latency of the last publication"))}
        # Past the cap, scenarios share one label: their counters add up, their gauges keep the last one seen.
        summed: dict[tuple[str, str], float] = {}
        learners = self.dep.learners()
        for name, learner in learners.items():
            scenario = self.scenario_label(name)
            for key in counters:
                value = getattr(learner, "counters", {}).get(key)
                if value is not None:
                    summed[key, scenario] = summed.get((key, scenario), 0) + value
            for key, value in _learner_gauges(learner).items():
                gauges[key].add_metric([scenario], value)
        for (key, scenario), value in summed.items():
            counters[key].add_metric([scenario], value)
        yield from counters.values()
        yield from gauges.values()
        yield _dropped_family(learners, self.scenario_label)


def _dropped_family(learners: dict, scenario_label: ScenarioLabels) -> CounterMetricFamily:
    """``reef_samples_dropped{scenario,reason}``: each learner's :meth:`dropped` (its processor's and its own)."""
    family = CounterMetricFamily("reef_samples_dropped", "Samples dropped or retired without training, by reason "
                                 "(judge failures, staleness, expiry, records gone...)", labels=["scenario", "reason"])
    summed: dict[tuple[str, str], float] = {}
    for name, learner in learners.items():
        dropped = getattr(learner, "dropped", None)
        counts = dropped() if callable(dropped) else {}
        scenario = scenario_label(name)
        for reason, n in (counts or {}).items():
            summed[scenario, str(reason)] = summed.get((scenario, str(reason)), 0) + n
    for (scenario, reason), value in sorted(summed.items()):
        family.add_metric([scenario, reason], value)
    return family


def _compacted_family(counts: dict, scenario_label: ScenarioLabels) -> CounterMetricFamily:
    """``reef_records_compacted{scenario,reason}``: record bodies retention compacted (consumed, expired,
    max_bytes), as the store counts them (read at start-up and after each background pass)."""
    family = CounterMetricFamily("reef_records_compacted", "Inference records whose bodies retention compacted, "
                                 "by reason (consumed, expired, max_bytes)", labels=["scenario", "reason"])
    summed: dict[tuple[str, str], float] = {}
    for name, reasons in (counts or {}).items():
        scenario = scenario_label(name)
        for reason, row in reasons.items():
            summed[scenario, reason] = summed.get((scenario, reason), 0) + row.get("records", 0)
    for (scenario, reason), value in sorted(summed.items()):
        family.add_metric([scenario, reason], value)
    return family


def _learner_gauges(learner) -> dict[str, float]:
    found: dict[str, float] = {}
    metrics = getattr(learner, "last_metrics", None) or {}
    reward = next((metrics[k] for k in ("reward_mean", "reward") if isinstance(metrics.get(k), (int, float))),
                  None)
    if reward is None:  # a trainer that namespaces its metrics, e.g. ``ttt/batch_reward_mean``
        reward = next((v for k, v in metrics.items() if k.endswith("reward_mean") and isinstance(v, (int, float))),
                      None)
    for key, value in (("reward", reward), ("loss", metrics.get("loss")),
                       ("policy_lag", metrics.get("policy_lag_mean"))):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[key] = float(value)
    published = getattr(learner, "release_metrics", None) or {}
    for release in reversed(list(published.values())):
        if isinstance(release.get("publish_latency_ms"), (int, float)):
            found["publish_latency_seconds"] = release["publish_latency_ms"] / 1000
            break
    return found


router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Every series, in the Prometheus text exposition format."""
    if request.query_params:
        raise ValidationFailed(f"/metrics takes no query parameters (got {sorted(request.query_params)[0]!r})")
    return Response(request.app.state.reef_metrics.render(), media_type=CONTENT_TYPE_LATEST)
