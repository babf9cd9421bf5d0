"""``observability.tracing`` against a real OTLP receiver on loopback (``reef_core.testing.otlp``: the protobuf
decoded by ``opentelemetry-proto``): one trace per inference on both dialects and streams, report spans linked to
the inferences they cite, learner step spans linked to the records they consumed, bodies only with
``include_content``, sampling by trace id, and a dead, slow or full exporter that never slows or fails serving."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reef_core.background import serve_asgi
from reef_core.client.server_process import free_port
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.observe.spans import record_ids, sampled, step_ids
from reef_core.serve.app import create_app
from reef_core.testing.fixtures import sse_events, wait_until
from reef_core.testing.otlp import GrpcReceiver, HttpReceiver

pytestmark = pytest.mark.timeout(120)

STEPS = ["recipe.name=steps", "recipe.processor=per_report", "+recipe.processor_options.batch_size=1",
         "recipe.trainer=reef_core.testing.step_trainer:StepTrainer", "recipe.surface=harness"]
FAST = ["observability.tracing.enabled=true", "observability.tracing.schedule_delay_s=0.05"]


@pytest.fixture
def serve(tmp_path, fake_upstream_url):
    def start(*overrides):
        cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                              f"storage.data_dir={tmp_path}/data", *FAST, *overrides])
        return serve_asgi(create_app(build_deployment(cfg)), lifespan="on")
    return start


def ids(scenario: str, record_id: str) -> tuple[str, str]:
    trace_id, span_id = record_ids(scenario, record_id)
    return f"{trace_id:032x}", f"{span_id:016x}"


def chat(url, scenario, text, stream=False, dialect="openai", **headers) -> str:
    """One inference; returns its receipt (from the header, or in-band at a stream's end)."""
    headers = {"x-reef-scenario": scenario, **headers}
    if dialect == "openai":
        path, body = "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/messages", {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    if not stream:
        answer = httpx.post(url + path, headers=headers, json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-reef-agent-record-id"]
    if dialect == "openai":  # else an OpenAI stream carries no usage, and its span no token counts
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + path, headers=headers, json={**body, "stream": True}, timeout=30) as answer:
        assert answer.status_code == 200
        events = sse_events(answer)
    receipts = [data["reef"]["agent_record_id"] for _, data in events if isinstance(data, dict) and "reef" in data]
    assert len(receipts) == 1, events
    return receipts[0]


def report(url, scenario, receipt, score=1.0, feedback=None) -> str:
    body = {"score": score, "references": [receipt], **({"feedback": feedback} if feedback else {})}
    answer = httpx.post(f"{url}/reef/report", headers={"x-reef-scenario": scenario}, json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["agent_record_id"]


def tracing_status(url) -> dict:
    return httpx.get(f"{url}/reef/status", timeout=30).json()["tracing"]


def metric(url, name, **labels) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def test_trace_ids_are_the_documented_derivation():
    digest = hashlib.sha256(b"math\x00rec-1").digest()
    assert record_ids("math", "rec-1") == (int.from_bytes(digest[:16], "big"), int.from_bytes(digest[16:24], "big"))
    step = hashlib.sha256(b"step\x00math\x003").digest()
    assert step_ids("math", 3)[0] == int.from_bytes(step[:16], "big")
    assert sampled(record_ids("math", "rec-1")[0], 1.0) and not sampled(record_ids("math", "rec-1")[0], 0.0)


def test_inferences_reports_and_steps_are_traced_and_linked(serve):
    with HttpReceiver() as receiver, serve(*STEPS, f"observability.tracing.endpoint={receiver.url}") as url:
        cases = [("openai", False), ("openai", True), ("anthropic", False), ("anthropic", True)]
        receipts = {chat(url, "agent", f"hi {i}", stream, dialect, **{"x-reef-tag-team": "blue"}): (dialect, stream)
                    for i, (dialect, stream) in enumerate(cases)}
        reports = {report(url, "agent", receipt, feedback="nice"): receipt for receipt in receipts}
        wait_until(lambda: len([s for s in receiver.spans if s.name == "reef.learner.step"]) >= 4, timeout=60,
                   what="four learner step spans")
        status = tracing_status(url)
        exported = metric(url, "reef_tracing_spans_exported_total")
    spans = receiver.spans
    inference = {s.attributes["reef.record_id"]: s for s in spans if s.attributes.get("reef.kind") == "inference"}
    assert set(inference) == set(receipts)  # one span each, in a trace of its own derived from its receipt
    assert len({s.trace_id for s in inference.values()}) == 4
    for receipt, (dialect, stream) in receipts.items():
        span = inference[receipt]
        assert (span.trace_id, span.span_id) == ids("agent", receipt)
        attrs = span.attributes
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
        assert attrs["gen_ai.provider.name"] == attrs["gen_ai.system"] == "openai"  # the upstream's dialect
        assert attrs["gen_ai.response.model"]
        assert attrs.get("gen_ai.usage.input_tokens", 0) > 0 and attrs["gen_ai.usage.output_tokens"] > 0, (dialect, stream, attrs)
        assert attrs["reef.scenario"] == "agent" and attrs["reef.tag.team"] == "blue"
        assert attrs["reef.stream"] is stream and attrs["reef.client_dialect"] == dialect
        assert attrs["reef.latency_ms"] >= attrs["reef.engine_ms"] >= 0 and span.end_ns >= span.start_ns
        assert "gen_ai.input.messages" not in attrs and "gen_ai.output.messages" not in attrs  # content is off
        assert span.resource["service.name"] == "reef"
    report_spans = {s.attributes["reef.record_id"]: s for s in spans if s.name == "reef.report"}
    assert set(report_spans) == set(reports)
    for report_id, cited in reports.items():
        span = report_spans[report_id]
        assert (span.trace_id, span.span_id) == ids("agent", report_id)
        assert [(t, s) for t, s, _ in span.links] == [ids("agent", cited)]
        assert span.attributes["reef.report.score"] == 1.0 and "reef.report.feedback" not in span.attributes
    steps = [s for s in spans if s.name == "reef.learner.step"]
    linked = {(t, s) for step in steps for t, s, _ in step.links}
    assert {ids("agent", receipt) for receipt in receipts} <= linked  # every inference trained, and linked
    for step in steps:
        assert step.attributes["reef.batch.size"] == len(step.links) >= 1
        assert step.attributes["reef.gate.decision"] == "select" and step.attributes["reef.release_id"]
        assert step.trace_id == f"{step_ids('agent', step.attributes['reef.step'])[0]:032x}"
    assert status["exported"] == len(spans) == exported and status["dropped"]["queue_full"] == 0


def test_grpc_with_content_and_headers_from_the_environment(serve, monkeypatch):
    monkeypatch.setenv("REEF_TEST_OTLP_AUTH", "Bearer s3cret")
    with GrpcReceiver() as receiver, serve(f"observability.tracing.endpoint={receiver.url}",
                                           "observability.tracing.protocol=grpc",
                                           "observability.tracing.include_content=true",
                                           "observability.tracing.service_name=reef-test",
                                           "+observability.tracing.headers.authorization=REEF_TEST_OTLP_AUTH") as url:
        receipt = chat(url, "grpc", "the secret word is pelican")
        report(url, "grpc", receipt, feedback="well said")
        wait_until(lambda: len(receiver.spans) >= 2, timeout=30, what="two spans over gRPC")
    by_kind = {s.attributes["reef.kind"]: s for s in receiver.spans}
    assert "pelican" in by_kind["inference"].attributes["gen_ai.input.messages"]
    assert by_kind["inference"].attributes["gen_ai.output.messages"]
    assert by_kind["report"].attributes["reef.report.feedback"] == "well said"
    assert by_kind["inference"].resource["service.name"] == "reef-test"
    assert all(h.get("authorization") == "Bearer s3cret" for h in receiver.headers)


def test_sampling_keeps_the_traces_their_ids_choose(serve):
    with HttpReceiver() as receiver, serve(f"observability.tracing.endpoint={receiver.url}",
                                           "observability.tracing.sample=0.5") as url:
        receipts = [chat(url, "sampled", f"q{i}", **{"x-reef-agent-record-id": f"q{i}"}) for i in range(16)]
        kept = {receipt for receipt in receipts if sampled(record_ids("sampled", receipt)[0], 0.5)}
        assert len(kept) == 9  # these 16 ids' trace ids: 9 fall under the ratio
        wait_until(lambda: tracing_status(url)["exported"] == len(kept), timeout=30, what="the sampled spans")
        assert tracing_status(url)["sampled_out"] == 16 - len(kept)
    assert {s.attributes["reef.record_id"] for s in receiver.spans} == kept


def test_a_dead_collector_never_slows_or_fails_serving(serve, caplog):
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    with serve(f"observability.tracing.endpoint={dead}", "observability.tracing.export_timeout_s=0.5") as url:
        started = time.perf_counter()
        for i in range(5):
            chat(url, "dead", f"q{i}")
        assert time.perf_counter() - started < 5  # no request waited for the collector
        wait_until(lambda: tracing_status(url)["dropped"]["export_failed"] >= 1, timeout=30, what="a failed export")
        status = tracing_status(url)
        assert status["export_failures"] >= 1 and status["exported"] == 0
        assert metric(url, "reef_tracing_spans_dropped_total", reason="export_failed") >= 1
        assert metric(url, "reef_tracing_export_failures_total") >= 1
        chat(url, "dead", "once more")
        wait_until(lambda: tracing_status(url)["export_failures"] >= 2, timeout=30, what="a second failed export")
    said = [r for r in caplog.records if r.name == "reef.tracing" and "export_failed" in r.getMessage()]
    assert len(said) == 1  # the loss is logged once, and counted every time


def test_a_full_queue_drops_and_counts_while_serving_goes_on(serve):
    with HttpReceiver() as receiver, serve(f"observability.tracing.endpoint={receiver.url}",
                                           "observability.tracing.max_queue_size=2",
                                           "observability.tracing.max_export_batch_size=1",
                                           "observability.tracing.export_timeout_s=1") as url:
        receiver.delay_s = 2.0  # a collector that hangs: each export runs into its deadline
        started = time.perf_counter()
        for i in range(8):
            chat(url, "full", f"q{i}")
        assert time.perf_counter() - started < 5
        status = tracing_status(url)
        assert status["dropped"]["queue_full"] >= 4 and status["queue_depth"] <= 2
        assert metric(url, "reef_tracing_spans_dropped_total", reason="queue_full") >= 4
        assert metric(url, "reef_tracing_queue_depth") <= 2
