"""What a record, a report or a learner step looks like as an OpenTelemetry span (``observability.tracing``).

Ids are derived, never drawn, so anything that knows a record's scenario and id knows its trace: a report links to
the inferences it cites and a learner step to the records it consumed without asking the store, and two processes
(workers, a restart) name one record's trace alike::

    digest   = sha256(utf8(scenario) + b"\\x00" + utf8(record_id))
    trace_id = digest[0:16]     span_id = digest[16:24]     (big-endian; an all-zero id becomes 1)

A learner step hashes ``b"step\\x00" + utf8(scenario) + b"\\x00" + str(step)`` the same way (a record id holds no NUL,
so the two never meet). Attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``), plus Reef's own
(``reef.*``); bodies (prompts, replies, feedback) only with ``include_content``. Imported only with the ``otel``
extra installed.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

#: The longest body attribute (``gen_ai.input.messages``...), in characters; longer ones are cut and say so.
MAX_CONTENT_CHARS = 65536
#: Links of one span at most (a learner step's consumed records); the rest are counted in ``reef.links_dropped``.
MAX_LINKS = 1024
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("reef")
_OPERATIONS = {"chat": "chat", "messages": "chat", "responses": "chat", "completions": "text_completion"}


def _ids(key: bytes) -> tuple[int, int]:
    digest = hashlib.sha256(key).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def record_ids(scenario: str, record_id: str) -> tuple[int, int]:
    """(trace id, span id) of a record's trace (inference, report or instruction)."""
    return _ids(scenario.encode() + b"\x00" + record_id.encode())


def step_ids(scenario: str, step: int) -> tuple[int, int]:
    """(trace id, span id) of a learner step's trace."""
    return _ids(b"step\x00" + scenario.encode() + b"\x00" + str(step).encode())


def sampled(trace_id: int, ratio: float) -> bool:
    """Kept at ``ratio`` by the trace id's low 64 bits (the rule of OpenTelemetry's TraceIdRatioBased sampler)."""
    return (trace_id & 0xFFFFFFFFFFFFFFFF) < round(ratio * 2**64)


class SpanBuilder:
    """Turns what the loop announces into :class:`ReadableSpan` values the OTLP exporters encode."""

    def __init__(self, service_name: str, include_content: bool, provider: str | None = None):
        """``provider``: ``gen_ai.provider.name``, what answers inference (the upstream's dialect behind a proxy, else
        ``engine.kind``: ``local``, ``sglang``, ``vllm``)."""
        from .. import __version__

        self.resource = Resource.create({"service.name": service_name, "service.version": __version__})
        self.include_content = include_content
        self.provider = provider

    def _span(self, name: str, ids: tuple[int, int], attributes: dict, start_s: float, end_s: float, *,
              kind: SpanKind = SpanKind.INTERNAL, links: list[Link] = (), error: str | None = None) -> ReadableSpan:
        status = Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET)
        context = SpanContext(ids[0], ids[1], is_remote=False, trace_flags=_SAMPLED)
        return ReadableSpan(name=name, context=context, resource=self.resource,
                            attributes={k: v for k, v in attributes.items() if v is not None}, links=links,
                            kind=kind, status=status, instrumentation_scope=_SCOPE,
                            start_time=int(start_s * 1e9), end_time=int(max(end_s, start_s) * 1e9))

    def record(self, record) -> ReadableSpan | None:
        """The span of a stored record: an inference or a report (an instruction has none)."""
        if record.kind == "inference":
            return self.inference(record)
        if record.kind == "report":
            return self.report(record)
        return None

    def inference(self, record) -> ReadableSpan:
        payload = record.payload
        request = payload.get("request") if isinstance(payload.get("request"), dict) else {}
        response = payload.get("response") if isinstance(payload.get("response"), dict) else {}
        timings = payload.get("timings") if isinstance(payload.get("timings"), dict) else {}
        operation = _OPERATIONS.get(payload.get("route"), "chat")
        model = _text(request.get("model"))
        usage = _usage(response)
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": self.provider, "gen_ai.system": self.provider,
            "gen_ai.request.model": model, "gen_ai.response.model": _text(response.get("model")),
            "gen_ai.response.id": _text(response.get("id")),
            "gen_ai.request.max_tokens": _int(request.get("max_tokens")),
            "gen_ai.request.temperature": _float(request.get("temperature")),
            "gen_ai.request.top_p": _float(request.get("top_p")),
            "gen_ai.response.finish_reasons": _finish_reasons(response),
            "gen_ai.usage.input_tokens": usage.get("input"), "gen_ai.usage.output_tokens": usage.get("output"),
            "reef.latency_ms": _float(timings.get("total_ms")), "reef.engine_ms": _float(timings.get("engine_ms")),
            "reef.stream": bool(payload.get("stream")), "reef.complete": record.complete,
            "reef.client_dialect": _text(payload.get("client_dialect")), "reef.engine": _engine(payload),
            "reef.release_id": _text(payload.get("release_id")), "reef.version": record.version,
            "reef.retry_of": _text(payload.get("retry_of")), "reef.pinned": _text(payload.get("pinned")),
            **self._common(record),
        }
        if self.include_content:
            attributes["gen_ai.input.messages"] = _content(_input_messages(request))
            attributes["gen_ai.output.messages"] = _content(_output(response))
        total_s = (_float(timings.get("total_ms")) or 0.0) / 1000
        error = _text(payload.get("error")) or (None if record.complete else "incomplete")
        return self._span(f"{operation} {model}" if model else operation, record_ids(record.scenario, record.record_id),
                          attributes, record.created_at, record.created_at + total_s, kind=SpanKind.SERVER,
                          error=error)

    def report(self, record) -> ReadableSpan:
        payload = record.payload
        references = list(dict.fromkeys(record.references))
        attributes = {"reef.report.score": _float(payload.get("score")),
                      "reef.report.references": len(references), **self._common(record)}
        if self.include_content and payload.get("feedback") is not None:
            attributes["reef.report.feedback"] = _content(payload.get("feedback"))
        links, dropped = self._links(record.scenario, references, record_ids)
        if dropped:
            attributes["reef.links_dropped"] = dropped
        now = record.created_at
        return self._span("reef.report", record_ids(record.scenario, record.record_id), attributes, now, now,
                          links=links)

    def step(self, scenario: str, row: dict) -> ReadableSpan:
        """A learner step's commit-log row: the batch it consumed, the gate's decision and the release it made."""
        consumed = [rid for rid in row.get("consumed_ids") or () if isinstance(rid, str)]
        decision = row.get("decision") if isinstance(row.get("decision"), dict) else {}
        metrics = row.get("metrics") if isinstance(row.get("metrics"), dict) else {}
        attributes = {"reef.scenario": scenario, "reef.step": _int(row.get("step")),
                      "reef.operation": _text(row.get("operation")), "reef.batch.size": len(consumed),
                      "reef.gate.decision": _text(decision.get("decision")) or ("error" if "train_error" in metrics
                                                                                 else None),
                      "reef.gate.policy": _text(decision.get("policy")), "reef.gate.reason": _text(decision.get("reason")),
                      "reef.release_id": _text(row.get("release_id")) or _text(row.get("live_release_id")),
                      "reef.pending": row.get("pending") if isinstance(row.get("pending"), bool) else None}
        for name, value in metrics.items():
            if isinstance(name, str) and _float(value) is not None and len(attributes) < 128:
                attributes[f"reef.metric.{name}"] = _float(value)
        links, dropped = self._links(scenario, consumed, record_ids)
        if dropped:
            attributes["reef.links_dropped"] = dropped
        end = time.time()
        train_s = _float(metrics.get("train_s")) or 0.0
        error = _text(metrics.get("train_error"))
        return self._span("reef.learner.step", step_ids(scenario, _int(row.get("step")) or 0), attributes,
                          end - train_s, end, links=links, error=error)

    @staticmethod
    def _links(scenario: str, ids: list[str], derive) -> tuple[list[Link], int]:
        links = []
        for rid in ids[:MAX_LINKS]:
            trace_id, span_id = derive(scenario, rid)
            links.append(Link(SpanContext(trace_id, span_id, is_remote=True, trace_flags=_SAMPLED),
                              {"reef.record_id": rid}))
        return links, max(len(ids) - MAX_LINKS, 0)

    @staticmethod
    def _common(record) -> dict:
        tags = {f"reef.tag.{name}": value for name, value in record.tags.items()
                if isinstance(name, str) and isinstance(value, str)}
        return {"reef.scenario": record.scenario, "reef.record_id": record.record_id, "reef.kind": record.kind, **tags}


def _engine(payload: dict) -> str | None:
    """The engine's name (a local model's), never an upstream's URL (``upstream:<url>``: the provider names it)."""
    engine = _text(payload.get("engine"))
    return None if engine is None or engine.startswith("upstream:") else engine


def _usage(response: dict) -> dict:
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    found = {"input": usage.get("prompt_tokens", usage.get("input_tokens")),
             "output": usage.get("completion_tokens", usage.get("output_tokens"))}
    return {k: v for k, v in found.items() if _int(v) is not None}


def _finish_reasons(response: dict) -> list[str] | None:
    if isinstance(response.get("choices"), list):
        reasons = [c.get("finish_reason") for c in response["choices"] if isinstance(c, dict)]
    else:
        reasons = [response.get("stop_reason")]
    reasons = [r for r in reasons if isinstance(r, str)]
    return reasons or None


def _input_messages(request: dict) -> Any:
    if "messages" in request:
        return {"system": request["system"], "messages": request["messages"]} if "system" in request \
            else request["messages"]
    return request.get("input", request.get("prompt"))


def _output(response: dict) -> Any:
    if isinstance(response.get("choices"), list):
        return [c.get("message", c.get("text")) for c in response["choices"] if isinstance(c, dict)]
    return response.get("content")


def _content(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > MAX_CONTENT_CHARS:
        return text[:MAX_CONTENT_CHARS] + f"...[{len(text) - MAX_CONTENT_CHARS} characters cut]"
    return text


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
            float("inf"), float("-inf")):
        return None
    return float(value)
