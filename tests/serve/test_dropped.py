"""Nothing is lost silently (#37): every sample a processor or the learner drops without training is counted by
reason in the scenario's status (``dropped``) and in ``/metrics`` (``reef_samples_dropped_total{scenario,reason}``),
and logged at WARNING the first time per scenario and reason."""

from __future__ import annotations

import logging

import httpx
import pytest

from reef_core.background import serve_asgi
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.observe.processor import DropCounter
from reef_core.serve.app import create_app
from reef_core.testing.fixtures import wait_until

from tests.serve.test_metrics import scrape, value

TOKEN = "dropped-token"
WAITING = ["recipe.name=steps", "recipe.processor=per_report", "+recipe.processor_options.batch_size=50",
           "recipe.trainer=reef_core.testing.step_trainer:StepTrainer", "recipe.surface=harness"]


@pytest.fixture
def server(tmp_path, fake_upstream_url):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}/data", f"server.tokens=[{TOKEN}]", *WAITING])
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:
        yield url


def _drop_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "reef.dropped" and r.levelno == logging.WARNING]


def test_drops_are_counted_by_reason_in_status_and_metrics_and_logged_once(server, caplog):
    caplog.set_level(logging.WARNING, logger="reef.dropped")
    auth = {"authorization": f"Bearer {TOKEN}", "x-reef-scenario": "drops"}
    receipt = httpx.post(f"{server}/v1/chat/completions", headers=auth,
                         json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert receipt.status_code == 200, receipt.text
    receipt = receipt.headers["x-reef-agent-record-id"]
    for score in (1.0, 0.5, 0.0):  # the first waits for its batch; the next two quote a held receipt
        answer = httpx.post(f"{server}/reef/report", headers=auth, json={"score": score, "references": [receipt]})
        assert answer.status_code == 200, answer.text

    def status() -> dict:
        answer = httpx.get(f"{server}/reef/scenarios/drops/status", headers=auth)
        assert answer.status_code == 200, answer.text
        return answer.json()

    wait_until(lambda: status()["dropped"].get("duplicate") == 2, timeout=30, what="two duplicate reports counted")
    found = status()
    assert found["dropped"] == {"duplicate": 2}
    assert found["processor"]["dropped"] == {"duplicate": 2}
    metrics = scrape(server, TOKEN)
    assert value(metrics, "reef_samples_dropped_total", scenario="drops", reason="duplicate") == 2
    lines = _drop_lines(caplog)
    assert len(lines) == 1, lines  # the first time only, though counted twice
    assert "drops" in lines[0] and "duplicate" in lines[0]
    # ... and where a person looks: the dashboard's scenario page lists them by reason.
    page = httpx.get(f"{server}/ui/scenarios/drops", headers={"authorization": f"Bearer {TOKEN}"})
    assert page.status_code == 200, page.text
    assert 'id="dropped"' in page.text and "<td>duplicate</td><td>2</td>" in page.text


def test_drop_counter_labels_a_detailed_reason_and_warns_once_per_reason(caplog):
    caplog.set_level(logging.WARNING, logger="reef.dropped")
    drops = DropCounter("s")
    drops.drop("trainer_refused: no log-probs", 3)
    drops.drop("trainer_refused: no log-probs again")
    drops.drop("stale")
    drops.drop("stale", 0)
    assert drops.counts() == {"stale": 1, "trainer_refused": 4}
    lines = _drop_lines(caplog)
    assert len(lines) == 2, lines
    assert "trainer_refused" in lines[0] and "scenario s" in lines[0] and "stale" in lines[1]
