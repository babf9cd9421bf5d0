"""OTLP export of the loop (``observability.tracing``): bounded, lossy, and off the request path.

The deployment hands its lifecycle notifications here (:meth:`Tracing.notify`): ``reef_record_stored`` (an inference
or a report, once durable) and ``reef_step_committed`` (a learner step's commit-log row). Taking one costs a hash and
an append to a bounded queue; a full queue drops the newcomer and counts it (``dropped["queue_full"]``). One daemon
thread builds the spans (:mod:`reef_core.observe.spans`) and sends them through the OpenTelemetry SDK's OTLP exporter
(http/protobuf or grpc), each export bounded by ``export_timeout_s``; a batch that fails is dropped and counted
(``dropped["export_failed"]``). So a dead or slow collector costs spans, never a request's time or answer, and
tracing reads what the loop has already decided: it takes no part in acceptance, deduplication or training.
Every kind of loss is logged once, the first time it happens, and counted in ``GET /reef/status`` and ``/metrics``.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("reef.tracing")

#: Why spans were lost: the queue was full, an export failed (or timed out), a span could not be built, or the
#: process stopped before they were sent.
DROP_REASONS = ("queue_full", "export_failed", "unencodable", "shutdown")
#: The longest :meth:`Tracing.close` waits for queued spans to be sent (a dead collector must not hold a shutdown).
CLOSE_TIMEOUT_S = 5.0


class Tracing:
    """One process's exporter. ``settings``: the ``observability.tracing`` section (checked); ``endpoint`` and
    ``headers``: the collector URL and the headers' values, as resolved at start-up; ``exporter``: an OpenTelemetry
    ``SpanExporter`` (tests may pass their own), else the OTLP exporter of ``settings.protocol``; ``provider``: what
    answers inference (``gen_ai.provider.name``)."""

    def __init__(self, settings: Any, endpoint: str, headers: dict[str, str], exporter=None,
                 provider: str | None = None):
        from .spans import SpanBuilder, record_ids, sampled, step_ids

        self.settings = settings
        self.endpoint = endpoint
        self._builder = SpanBuilder(settings.service_name, settings.include_content, provider)
        self._record_ids, self._step_ids, self._sampled = record_ids, step_ids, sampled
        self._exporter = exporter if exporter is not None else _otlp_exporter(settings, self.endpoint, headers)
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {"exported": 0, "sampled_out": 0, "export_failures": 0}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._told: set[str] = set()

    # -- the request path: a hash and an append ------------------------------------------------------

    def notify(self, hook_name: str, **kwargs) -> None:
        """Take a lifecycle notification of the deployment; never raises, never blocks on the exporter."""
        try:
            if hook_name == "reef_record_stored":
                record = kwargs["record"]
                if record.kind in ("inference", "report"):
                    self._offer(self._record_ids(record.scenario, record.record_id)[0], ("record", record))
            elif hook_name == "reef_step_committed":
                scenario, row = kwargs["scenario"], kwargs["row"]
                self._offer(self._step_ids(scenario, int(row.get("step") or 0))[0], ("step", scenario, row))
        except Exception:  # noqa: BLE001 - tracing must never fail what it watches
            self._lose("unencodable", 1)

    def _offer(self, trace_id: int, item: tuple) -> None:
        if not self._sampled(trace_id, self.settings.sample):
            with self._lock:
                self.counts["sampled_out"] += 1
            return
        with self._lock:
            full = len(self._queue) >= self.settings.max_queue_size or self._closing.is_set()
            if not full:
                self._queue.append(item)
                ready = len(self._queue) >= self.settings.max_export_batch_size
        if full:
            self._lose("shutdown" if self._closing.is_set() else "queue_full", 1)
        elif ready:
            self._wake.set()

    # -- the exporter thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            for name in _EXPORTER_LOGGERS:  # their retry and failure lines, each kind once (our counters keep the rest)
                logger = logging.getLogger(name)
                if not any(isinstance(f, _Once) for f in logger.filters):
                    logger.addFilter(_Once())
            self._thread = threading.Thread(target=self._run, name="reef-tracing", daemon=True)
            self._thread.start()
            log.info("tracing: exporting to %s (%s, sample %g)", _shown(self.endpoint), self.settings.protocol,
                     self.settings.sample)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.settings.schedule_delay_s)
            self._wake.clear()
            while self._export_batch():
                pass
            if self._closing.is_set():
                return

    def _export_batch(self) -> bool:
        """Send up to one batch; False when the queue was empty."""
        with self._lock:
            count = min(len(self._queue), self.settings.max_export_batch_size)
            items = [self._queue.popleft() for _ in range(count)]
        if not items:
            return False
        spans = []
        for item in items:
            try:
                span = self._builder.record(item[1]) if item[0] == "record" else self._builder.step(item[1], item[2])
            except Exception:  # noqa: BLE001 - a record the builder cannot read costs its span, not the batch
                log.debug("tracing: span of %r not built", item[:2], exc_info=True)
                self._lose("unencodable", 1)
                continue
            if span is not None:
                spans.append(span)
        if spans:
            self._send(spans)
        return True

    def _send(self, spans: list) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._exporter.export(spans)
        except Exception:  # noqa: BLE001 - an exporter that raises fails its batch like one that says so
            result = None
            log.debug("tracing: export raised", exc_info=True)
        if result == SpanExportResult.SUCCESS:
            with self._lock:
                self.counts["exported"] += len(spans)
            return
        with self._lock:
            self.counts["export_failures"] += 1
        self._lose("export_failed", len(spans))

    def _lose(self, reason: str, count: int) -> None:
        with self._lock:
            self.dropped[reason] += count
            first = reason not in self._told
            self._told.add(reason)
        if first:
            log.warning("tracing: spans dropped (%s; counted in /reef/status and reef_tracing_spans_dropped_total, "
                        "logged once)", reason)

    # -- shutdown and status -----------------------------------------------------------------------------

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued for up to ``timeout`` seconds, then stop; what is left is counted as dropped."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            left = len(self._queue)
            self._queue.clear()
        if left:
            self._lose("shutdown", left)
        if self._thread is None or not self._thread.is_alive():
            try:
                self._exporter.shutdown()
            except Exception:  # noqa: BLE001
                log.debug("tracing: exporter shutdown failed", exc_info=True)

    def stats(self) -> dict:
        """Counters for ``GET /reef/status`` and ``/metrics``."""
        with self._lock:
            return {"endpoint": _shown(self.endpoint), "protocol": self.settings.protocol,
                    "sample": self.settings.sample, "queue_depth": len(self._queue),
                    "max_queue_size": self.settings.max_queue_size, **self.counts, "dropped": dict(self.dropped)}


#: Where the OTLP exporters log a failed or retried export (on every batch, while a collector is down).
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                     "opentelemetry.exporter.otlp.proto.grpc.exporter")


class _Once(logging.Filter):
    """Passes the first line of each message template, so a dead collector is said once, not on every export."""

    def __init__(self):
        super().__init__()
        self._seen: set[tuple[str, object]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def _otlp_exporter(settings: Any, endpoint: str, headers: dict[str, str]):
    timeout = settings.export_timeout_s
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"), headers=headers or None,
                                timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, headers=headers or None, timeout=timeout)


def _shown(url: str) -> str:
    """``url`` without user information (a password in a collector URL is never shown)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
