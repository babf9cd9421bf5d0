"""``GET /metrics``: Prometheus text that prometheus_client parses, counters that move with requests, reports
and training steps, the token rule, a bounded scenario label and the cost of a scrape."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from reef_core.config import compose_config
from reef_core.errors import ConfigError
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app
from reef_core.serve.middleware.metrics import OVERFLOW, ScenarioLabels, ServeMetrics
from reef_core.testing.fixtures import wait_until
from reef_core.background import serve_asgi

TOKEN, ADMIN = "metrics-inference-token", "metrics-admin-token"
STEPS = ["recipe.name=steps", "recipe.processor=per_report", "+recipe.processor_options.batch_size=1",
         "recipe.trainer=reef_core.testing.step_trainer:StepTrainer", "recipe.surface=harness"]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample as ``(name, sorted labels) -> value`` (parsing fails loudly on malformed text)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in found.items() if n == name and labels.items() <= dict(ls).items())


@pytest.fixture
def app_url(tmp_path, fake_upstream_url):
    def start(*overrides):
        cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                              f"storage.data_dir={tmp_path}/data", f"server.tokens=[{TOKEN}]",
                              f"server.admin_tokens=[{ADMIN}]", *overrides])
        return serve_asgi(create_app(build_deployment(cfg)), lifespan="on")
    return start


def scrape(url: str, token: str = TOKEN) -> dict:
    response = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


def test_counters_move_with_requests_reports_and_steps(app_url):
    auth = {"authorization": f"Bearer {TOKEN}", "x-reef-scenario": "agent"}
    with app_url(*STEPS) as url:
        before = scrape(url)
        assert value(before, "reef_requests_total", scenario="agent") == 0
        receipts = []
        for i in range(3):
            answer = httpx.post(f"{url}/v1/chat/completions", headers=auth,
                                json={"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]})
            assert answer.status_code == 200
            receipts.append(answer.headers["x-reef-agent-record-id"])
        assert httpx.post(f"{url}/v1/chat/completions", headers=auth, json={"model": "m"}).status_code == 400
        assert httpx.get(f"{url}/reef/scenarios", headers={"authorization": "Bearer wrong"}).status_code == 401
        for receipt in receipts:
            report = httpx.post(f"{url}/reef/report", headers=auth, json={"score": 1.0, "references": [receipt]})
            assert report.status_code == 200, report.text
        def decided(found):
            return sum(value(found, f"reef_learner_{k}_total", scenario="agent") for k in ("selected", "rejected"))
        # A step is counted before its gate's decision: wait for three decisions.
        wait_until(lambda: decided(scrape(url)) >= 3, timeout=60, what="three training steps decided")
        after = scrape(url)
    chat = dict(route="chat", dialect="openai", scenario="agent")
    assert value(after, "reef_requests_total", status="200", **chat) == 3
    # Refused at the door, before its scenario is read: counted without one.
    assert value(after, "reef_requests_total", route="chat", dialect="openai", status="400", scenario="") == 1
    assert value(after, "reef_requests_total", route="/reef/report", status="200") == 3
    assert value(after, "reef_requests_total", route="unmatched", status="401", scenario="") == 1
    # Every answered chat has its added and upstream latency observed, and its token counts.
    assert value(after, "reef_added_latency_seconds_count", route="chat") == 3
    assert value(after, "reef_upstream_latency_seconds_count", route="chat") == 3
    assert value(after, "reef_tokens_total", direction="in", scenario="agent") > 0
    assert value(after, "reef_tokens_total", direction="out", scenario="agent") > 0
    # Reports became steps, each one selected or rejected by the gate; records went through the writer.
    steps = value(after, "reef_learner_steps_total", scenario="agent")
    assert decided(after) == steps >= 3
    assert value(after, "reef_learner_selected_total", scenario="agent") >= 1
    assert value(after, "reef_record_writer_appends_total") >= 6 > value(before, "reef_record_writer_appends_total")
    assert value(after, "reef_record_writer_commit_seconds_total") > 0
    assert value(after, "reef_record_writer_queue_depth") >= 0
    assert ("reef_plugin_load_failures", ()) in after


def test_metrics_needs_a_token_unless_public(app_url):
    with app_url() as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics?x=1", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 400
        scrape(url)
    with app_url("server.metrics_public=true") as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        # Public metrics open nothing else.
        assert httpx.get(f"{url}/reef/scenarios").status_code == 401


def test_scenario_label_is_capped_with_an_overflow_label():
    labels = ScenarioLabels(2)
    assert [labels(n) for n in ("a", "b", "c", "a", "d", None)] == ["a", "b", OVERFLOW, "a", OVERFLOW, ""]
    with pytest.raises(ConfigError, match="server.metrics_max_scenarios"):
        ServeMetrics(object(), 0)


class _Learner:
    def __init__(self, i):
        self.counters = {"steps": i, "selected": i // 2, "rejected": i - i // 2}
        self.last_metrics = {"reward_mean": i / 100, "loss": 1 / (i + 1), "policy_lag_mean": 0.5}
        self.release_metrics = {f"r{j}": {"publish_latency_ms": 12.0 + j} for j in range(20)}


class _Deployment:
    def __init__(self, n):
        self._learners = {f"scenario-{i:03d}": _Learner(i) for i in range(n)}

    def learners(self):
        return dict(self._learners)

    def writer_stats(self):
        return None

    def plugin_failures(self):
        return {}

    def tracing_stats(self):
        return None

    def compaction_counts(self):
        return {}


def test_scrape_of_100_scenarios_is_cheap_and_bounded():
    metrics = ServeMetrics(_Deployment(110), 100)
    for i in range(110):  # every scenario also served requests
        metrics.observe("chat", "openai", 200, 0.0105,
                        {"scenario": f"scenario-{i:03d}", "engine_ms": 10.0, "tokens_in": 5, "tokens_out": 7})
    found = samples(metrics.render().decode())
    scenarios = {dict(ls).get("scenario") for (n, ls) in found if n == "reef_learner_steps_total"}
    assert len(scenarios) == 101 and OVERFLOW in scenarios  # 100 named, the 10 others summed under _other
    assert value(found, "reef_learner_steps_total", scenario=OVERFLOW) == sum(range(100, 110))
    assert value(found, "reef_learner_publish_latency_seconds", scenario="scenario-007") == pytest.approx(0.031)
    assert value(found, "reef_requests_total", scenario=OVERFLOW) == 10
    # Cheap: Reef's renderer against prometheus-client's own writer on the same series, interleaved, in CPU time
    # (a ratio stays put on a loaded machine where an absolute budget does not; x0.3-0.6 seen, 1100 lines).
    ours, library = [], []
    for _ in range(15):
        for costs, render in ((ours, metrics.render), (library, lambda: generate_latest(metrics.registry))):
            started = time.thread_time()
            render()
            costs.append(time.thread_time() - started)
    ratio = sorted(ours)[len(ours) // 2] / sorted(library)[len(library) // 2]
    assert ratio < 0.9, f"a scrape costs x{ratio:.2f} of prometheus-client's generate_latest"
