"""SAO gated by ``score_comparison`` over HTTP: a candidate made worse on purpose is rejected, an improved one is
selected and serves (issue #14 item 3).

The deployment is Reef's app composed with ``+recipe=sao +sao_profile=tiny`` (the tiny model on the local engine),
served on loopback in this process and driven with the openai SDK. Its trainer is SAO's own, wrapped by
``reef_core.testing.steering`` (registered under another name for the test): after each SAO step the candidate's weights are steered so its replies use
only two letters, consonants for the first candidate (the vowels verifier scores 0) and vowels for the second (1).
The gate runs the evaluation task file on the trainer's private engine for the candidate and for the release that
serves (sampled at temperature 1 with a fixed seed, so the base model scores between 0 and 1 and the comparison is
repeatable).
"""

from __future__ import annotations

import json
from importlib import resources

import httpx
import pytest
from openai import OpenAI

from reef_core import hookimpl
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.plugins import PluginManager
from reef_core.serve.names import RECEIPT_HEADER
from reef_core.serve.app import create_app
from reef_core.serve.background import serve_asgi
from reef_core.testing.fixtures import wait_until
from reef_core.testing.steering import SteeredTrainer

pytestmark = pytest.mark.slow

SCENARIO = "vowels-gated"


def _eval_tasks(path, count=4):
    lines = resources.files("reef_sao").joinpath("data/vowels.jsonl").read_text().splitlines()
    path.write_text("\n".join(lines[-count:]) + "\n")  # prompts the client does not send
    return [json.loads(line) for line in lines[:8]]


class SteeredSAO:
    """Trainer ``steered-sao``: SAO's trainer, its first candidate steered to consonants, its second to vowels."""

    @staticmethod
    @hookimpl
    def reef_register_trainers(register):
        def factory(**kwargs):
            from reef_sao.trainer import make_sao_trainer

            return SteeredTrainer(make_sao_trainer(**kwargs), ["zx", "ae"])

        register("steered-sao", factory)


@pytest.fixture
def server(tmp_path):
    tasks_file = tmp_path / "eval.jsonl"
    rollout_tasks = _eval_tasks(tasks_file)
    pm = PluginManager(extra_plugins=(SteeredSAO,))
    cfg = compose_config([
        "+recipe=sao", "+sao_profile=tiny", "engine.seed=0", "seed=0", f"storage.data_dir={tmp_path / 'data'}",
        "recipe.trainer=steered-sao",
        "evaluation.policy=score_comparison", "evaluation.evaluator=python",
        "+evaluation.options.evaluator.path=reef_sao.tasks:verify",
        "+evaluation.options.generation.temperature=1.0", "+evaluation.options.generation.seed=0",
        f"evaluation.tasks={tasks_file}"], pm)
    with serve_asgi(create_app(build_deployment(cfg, pm)), lifespan="on") as url:
        yield url, rollout_tasks


def test_score_comparison_rejects_a_sabotaged_candidate_and_selects_an_improved_one(server):
    url, rollout_tasks = server
    client = OpenAI(base_url=f"{url}/v1", api_key="reef", default_headers={"x-reef-scenario": SCENARIO})
    http = httpx.Client(base_url=url, headers={"x-reef-scenario": SCENARIO}, timeout=60)

    def commits():
        rows = http.get(f"/reef/scenarios/{SCENARIO}/commits", params={"limit": 100}).json()["commits"]
        return [c for c in rows if c.get("decision")]

    # Two batches of 4 scored rollouts: two candidates, one after the other.
    for task in rollout_tasks:
        raw = client.chat.completions.with_raw_response.create(model="reef", messages=task["messages"])
        receipt = raw.headers[RECEIPT_HEADER]
        http.post("/reef/report", json={"score": 0.5, "references": [receipt]}).raise_for_status()
    def status():
        return http.get(f"/reef/scenarios/{SCENARIO}/status").json()

    # The counters move after the commit row and the activation: waiting on them sees the step whole.
    wait_until(lambda: (c := status()["counters"])["selected"] + c["rejected"] >= 2, timeout=60,
               what="two gate decisions")
    decided = commits()
    assert len(decided) == 2
    worse, better = decided
    assert worse["decision"]["decision"] == "reject" and worse["metrics"]["steered"] == "zx"
    assert better["decision"]["decision"] == "select" and better["metrics"]["steered"] == "ae"
    for row in (worse, better):
        evaluation = row["decision"]["evaluation"]
        assert evaluation["evaluator"] == "python" and len(evaluation["scores"]) == 4
        assert any(0 < b < 1 for b in evaluation["baseline_scores"])  # the base model, sampled
    assert worse["decision"]["evaluation"]["scores"] == [0.0] * 4
    assert better["decision"]["evaluation"]["scores"] == [1.0] * 4
    assert worse["decision"]["metrics"]["losses"] > 0 and worse["decision"]["metrics"]["wins"] == 0
    assert better["decision"]["metrics"]["wins"] == 4

    now = status()
    assert now["counters"]["rejected"] == 1 and now["counters"]["selected"] == 1
    assert now["last_error"] is None
    releases = http.get(f"/reef/scenarios/{SCENARIO}/releases").json()["releases"]
    current = [r for r in releases if r["current"]]
    assert len(current) == 1 and current[0]["operation"] == "training"
    assert [r["operation"] for r in releases].count("training") == 1  # the rejected candidate published nothing

    # The selected weights serve: a greedy reply uses the improved letters only.
    reply = client.chat.completions.create(model="reef", messages=rollout_tasks[0]["messages"], temperature=0)
    text = reply.choices[0].message.content
    assert text and set(text) <= {"a", "e"}, text
