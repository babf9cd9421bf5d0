"""``reef eval releases`` on a real SAO scenario (issue #38's acceptance): the tiny model's offline loop publishes 10
training releases after its creation release, the command scores every one on held-out tasks through a private
engine and records nothing, ``GET /reef/scenarios/{s}/evaluations`` serves the result, and the dashboard plots one
point per release in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by selenium)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sqlite3
from pathlib import Path

import httpx
import pytest

from reef_core.background import serve_asgi
from reef_core.cli import main
from reef_core.commit.git_store import GitArtifactStore
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.loop.offline import job_config, run_learning
from reef_core.serve.app import create_app

tasks_module = pytest.importorskip("reef_sao.tasks")
pytest.importorskip("selenium.webdriver")
from reef_core.testing.browser import chromium  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

SCENARIO, TOKEN = "learn", "eval-token"
OVERRIDES = ["+recipe=sao", "+sao_profile=tiny", "seed=0"]
ROLLOUTS = 40  # batches of 4: ten training releases after the creation release


def _records(data: Path) -> int:
    with sqlite3.connect(data / "records.db") as db:
        return db.execute("select count(*) from records").fetchone()[0]


def _chain(data: Path, tmp: Path) -> list[tuple[str, bool]]:
    store = GitArtifactStore(data / "artifacts.git", tmp / "reader")
    return [(r.release_id, r.current) for r in reversed(store.releases(SCENARIO))]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, _shared_model_cache):
    """(data dir, held-out task file, the chain oldest first) after a 40-rollout SAO run (about 10 s)."""
    out = tmp_path_factory.mktemp("sao-eval")
    cfg = compose_config([*OVERRIDES, f"learn.rollouts={ROLLOUTS}"])
    metrics = run_learning(cfg, out / "job")
    assert metrics["versions_published"] == 10 and metrics["errors"] == 0, metrics
    data = out / "job" / "data"
    # Held out: prompts the loop never saw (another seed of the stream), in two sets tagged by their alphabet.
    lines = [{"id": t.task_id, "messages": t.messages(), "alphabet": t.alphabet, "set": name}
             for name, alphabet, seed in (("vowels", "aeiou", 101), ("xyz", "xyz", 102))
             for t in tasks_module.task_stream(4, seed=seed, alphabet=alphabet)]
    tasks = out / "held-out.jsonl"
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return data, tasks, _chain(data, out)


def evaluate(capsys, data: Path, tasks: Path, *args: str, verifier: str | None = None) -> dict:
    extra = [f"learn.verifier_options.path={verifier}"] if verifier else []
    code = main(["eval", "releases", "--scenario", SCENARIO, "--tasks", str(tasks), *args, *OVERRIDES,
                 f"storage.data_dir={data}", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return json.loads(out)


@pytest.fixture(scope="module")
def evaluated(scenario, tmp_path_factory):
    """The acceptance run: every release scored with the task's own verifier, kept for the dashboard."""
    data, tasks, chain = scenario
    records = _records(data)
    out, err = io.StringIO(), io.StringIO()  # a module fixture has no capsys
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["eval", "releases", "--scenario", SCENARIO, "--tasks", str(tasks), *OVERRIDES,
                     f"storage.data_dir={data}"])
    assert code == 0, err.getvalue()[-3000:]
    doc = json.loads(out.getvalue())
    # Nothing recorded, trained or published.
    assert _records(data) == records
    assert _chain(data, tmp_path_factory.mktemp("after")) == chain
    return doc


def test_every_release_of_the_sao_scenario_is_scored_in_chain_order(scenario, evaluated):
    data, _, chain = scenario
    doc = evaluated
    assert len(chain) == 11
    assert [(row["release_id"], row["current"]) for row in doc["releases"]] == chain
    assert [row["index"] for row in doc["releases"]] == list(range(11))
    assert doc["releases"][0]["operation"] == "creation" and doc["kind"] == "weights"
    assert doc["sets"] == {"vowels": 4, "xyz": 4}
    for row in doc["releases"]:
        assert row["episodes"] == {"vowels": 4, "xyz": 4} and row["failed"] == {"vowels": 0, "xyz": 0}, row
        assert all(0.0 <= row["scores"][name] <= 1.0 for name in ("vowels", "xyz"))
    assert doc["generation"] == {"temperature": 0.0, "max_tokens": 8, "seed": 0}  # greedy, learn.max_tokens
    assert set(doc["forgetting"]["sets"]) == {"vowels", "xyz"}
    assert Path(doc["path"]).parent.parent == data / "evaluations"


def test_each_release_answers_with_its_own_weights_whatever_came_before(scenario, capsys):
    """Scores that change with every reply (a digest of it): the trained releases answer differently from the
    base, and one release evaluated alone scores what it scored after the others (no weights leak between them)."""
    data, tasks, chain = scenario
    digest = "reef_core.testing.verifiers:reply_digest"
    full = evaluate(capsys, data, tasks, "--no-save", verifier=digest)
    scores = [row["scores"] for row in full["releases"]]
    assert len({json.dumps(s, sort_keys=True) for s in scores}) > 1
    middle = chain[5][0]
    alone = evaluate(capsys, data, tasks, "--from", middle, "--to", middle[:10], "--no-save", verifier=digest)
    assert [row["release_id"] for row in alone["releases"]] == [middle]
    assert alone["releases"][0]["scores"] == scores[5]
    last = evaluate(capsys, data, tasks, "--last", "1", "--no-save", verifier=digest)
    assert [row["release_id"] for row in last["releases"]] == [chain[-1][0]]
    assert last["releases"][0]["scores"] == scores[-1]


@pytest.fixture(scope="module")
def server(scenario, evaluated):
    data = scenario[0]
    cfg = job_config(compose_config([*OVERRIDES, f"server.tokens=[{TOKEN}]"]), data.parent)
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:
        yield url


def test_the_evaluations_route_serves_the_run_and_checks_its_inputs(server, evaluated):
    auth = {"authorization": f"Bearer {TOKEN}"}
    found = httpx.get(f"{server}/reef/scenarios/{SCENARIO}/evaluations", headers=auth, timeout=30)
    assert found.status_code == 200 and found.headers["cache-control"] == "no-store"
    runs = found.json()["evaluations"]
    assert [run["created_at"] for run in runs] == [evaluated["created_at"]]
    assert runs[0]["releases"] == evaluated["releases"] and "path" not in runs[0]
    for query, status, field in (("?limit=0", 400, "limit"), ("?limit=101", 400, "limit"), ("?limit=x", 400, "limit")):
        refused = httpx.get(f"{server}/reef/scenarios/{SCENARIO}/evaluations{query}", headers=auth, timeout=30)
        assert refused.status_code == status and field in refused.text
    assert httpx.get(f"{server}/reef/scenarios/nope/evaluations", headers=auth, timeout=30).status_code == 404
    assert httpx.get(f"{server}/reef/scenarios/{SCENARIO}/evaluations", timeout=30).status_code == 401
    spec = httpx.get(f"{server}/openapi.json", headers=auth, timeout=30).json()
    assert "get" in spec["paths"]["/reef/scenarios/{scenario}/evaluations"]


@pytest.fixture
def browser():
    yield from chromium("1280,2000")


def test_the_dashboard_plots_one_point_per_evaluated_release(server, evaluated, browser, tmp_path):
    browser.get(f"{server}/ui/login")
    browser.find_element(By.NAME, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(browser, 30).until(lambda driver: driver.current_url.endswith("/ui"))
    browser.get(f"{server}/ui/scenarios/{SCENARIO}")
    artifacts = Path(os.environ.get("REEF_TEST_ARTIFACTS", tmp_path)) / "dashboard"
    artifacts.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(artifacts / "score-by-release.png"))
    rows = evaluated["releases"]
    for name in ("vowels", "xyz"):
        figure = browser.find_element(By.CSS_SELECTOR, f"figure[data-series=release-score-{name}]")
        assert f"score by release: {name}" in figure.text
        points = figure.find_elements(By.CSS_SELECTOR, "circle.pt")
        assert len(points) == len(rows) == 11
        titles = [p.find_element(By.TAG_NAME, "title").get_attribute("textContent") for p in points]
        assert titles == [f"release {row['index']}: {row['scores'][name]:.3g}" for row in rows]
    table = browser.find_elements(By.CSS_SELECTOR, "#release-scores tr.evaluated")
    assert [r.find_element(By.TAG_NAME, "code").text for r in table] == [row["release_id"][:12] for row in rows]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#forgetting tr.forgetting")) == 2
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    assert (artifacts / "score-by-release.png").stat().st_size > 1000
