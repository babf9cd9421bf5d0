"""SAO gated by ``score_comparison`` over HTTP: a candidate made worse on purpose is rejected, an improved one is
selected and serves (issue #14 item 3).

The deployment is Reef's app composed with ``+recipe=sao +sao_profile=tiny`` (the tiny model on the local engine),
served on loopback in this process and driven with the openai SDK. Its trainer is SAO's own, wrapped by
``reef_core.testing.steering`` (registered under another name for the test): after each SAO step the candidate's
weights are steered so its replies use only two letters, consonants for the first candidate (the vowels verifier
scores 0) and vowels for the second (1). The gate runs on the trainer's private engine, with the tasks of
``evaluation.tasks`` (candidate and serving release, sampled at temperature 1 with a fixed seed, so the base model
scores between 0 and 1 and the comparison is repeatable), or with ``replay``: held-out records, never trained on,
whose reported scores are the baseline.
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
from reef_core.observe.processors.per_report import in_holdout
from reef_core.plugins import PluginManager
from reef_core.serve.routes.names import RECORD_ID_HEADER
from reef_core.serve.app import create_app
from reef_core.background import serve_asgi
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
def serve(tmp_path):
    """``serve(*overrides)``: the steered SAO deployment on loopback, gated by ``score_comparison``; its base URL."""
    servers = []

    def start(*overrides: str) -> str:
        pm = PluginManager(extra_plugins=(SteeredSAO,))
        cfg = compose_config([
            "+recipe=sao", "+sao_profile=tiny", "engine.seed=0", "seed=0", f"storage.data_dir={tmp_path / 'data'}",
            "recipe.trainer=steered-sao", "evaluation.policy=score_comparison", *overrides], pm)
        servers.append(serve_asgi(create_app(build_deployment(cfg, pm)), lifespan="on"))
        return servers[-1].__enter__()

    yield start
    for server in servers:
        server.__exit__(None, None, None)


class Client:
    """The openai SDK for rollouts, httpx for reports and the scenario's read routes."""

    def __init__(self, url: str):
        self.openai = OpenAI(base_url=f"{url}/v1", api_key="reef", default_headers={"x-reef-scenario": SCENARIO})
        self.http = httpx.Client(base_url=url, headers={"x-reef-scenario": SCENARIO}, timeout=60)

    def rollout(self, messages, **extra) -> tuple[str, str]:
        """(receipt, reply text)."""
        raw = self.openai.chat.completions.with_raw_response.create(model="reef", messages=messages, **extra)
        return raw.headers[RECORD_ID_HEADER], raw.parse().choices[0].message.content

    def report(self, receipt: str, score: float) -> None:
        self.http.post("/reef/report", json={"score": score, "references": [receipt]}).raise_for_status()

    def get(self, route: str, **params) -> dict:
        return self.http.get(f"/reef/scenarios/{SCENARIO}/{route}", params=params).json()

    def decisions(self, count: int) -> list[dict]:
        """The first ``count`` gate decisions, once the learner has counted them (after commit and activation)."""
        wait_until(lambda: (c := self.get("status")["counters"])["selected"] + c["rejected"] >= count, timeout=60,
                   what=f"{count} gate decisions")
        rows = [c for c in self.get("commits", limit=100)["commits"] if c.get("decision")]
        assert len(rows) == count
        return rows

    def check_outcome(self, worse: dict, better: dict, messages) -> None:
        """The sabotaged candidate was rejected and published nothing; the improved one serves."""
        assert worse["decision"]["decision"] == "reject" and worse["metrics"]["steered"] == "zx"
        assert better["decision"]["decision"] == "select" and better["metrics"]["steered"] == "ae"
        status = self.get("status")
        assert status["counters"]["rejected"] == 1 and status["counters"]["selected"] == 1
        assert status["last_error"] is None
        releases = self.get("releases")["releases"]
        current = [r for r in releases if r["current"]]
        assert len(current) == 1 and current[0]["operation"] == "training"
        assert [r["operation"] for r in releases].count("training") == 1
        _, text = self.rollout(messages, temperature=0)  # the selected weights serve
        assert text and set(text) <= {"a", "e"}, text


def test_score_comparison_rejects_a_sabotaged_candidate_and_selects_an_improved_one(serve, tmp_path):
    tasks_file = tmp_path / "eval.jsonl"
    rollout_tasks = _eval_tasks(tasks_file)
    client = Client(serve("evaluation.evaluator=python",
                          "+evaluation.options.evaluator.path=reef_sao.tasks:verify_letter_share",
                          "+evaluation.options.generation.temperature=1.0", "+evaluation.options.generation.seed=0",
                          f"evaluation.tasks={tasks_file}"))
    # Two batches of 4 scored rollouts: two candidates, one after the other.
    for task in rollout_tasks:
        receipt, _ = client.rollout(task["messages"])
        client.report(receipt, 0.5)
    worse, better = client.decisions(2)

    for row in (worse, better):
        evaluation = row["decision"]["evaluation"]
        assert evaluation["evaluator"] == "python" and len(evaluation["scores"]) == 4
        assert any(0 < b < 1 for b in evaluation["baseline_scores"])  # the base model, sampled
    assert worse["decision"]["evaluation"]["scores"] == [0.0] * 4
    assert better["decision"]["evaluation"]["scores"] == [1.0] * 4
    assert worse["decision"]["metrics"]["losses"] > 0 and worse["decision"]["metrics"]["wins"] == 0
    assert better["decision"]["metrics"]["wins"] == 4
    client.check_outcome(worse, better, rollout_tasks[0]["messages"])


def test_replay_gates_on_held_out_records_against_their_reported_scores(serve):
    client = Client(serve("evaluation.evaluator=replay", "+evaluation.options.evaluator.scorer=python",
                          "+evaluation.options.evaluator.path=reef_sao.tasks:verify_letter_share",
                          "+recipe.processor_options.holdout=0.3"))
    tasks = [json.loads(line) for line in
             resources.files("reef_sao").joinpath("data/vowels.jsonl").read_text().splitlines()]
    # Roll out until 8 receipts train and 2 are held out (the hold-out hashes record ids: the client can tell).
    held, trained = [], []
    for task in tasks[:40]:
        receipt, _ = client.rollout(task["messages"])
        (held if in_holdout(receipt, 0.3) else trained).append((receipt, task))
        if len(held) >= 2 and len(trained) >= 8:
            break
    held, trained = held[:2], trained[:8]
    assert len(held) == 2 and len(trained) == 8
    for receipt, _ in held:  # reported first, so both candidates are gated on them
        client.report(receipt, 0.5)
    wait_until(lambda: client.get("status")["processor"]["replay_tasks"] == 2, timeout=30, what="two replay tasks")
    for receipt, _ in trained:
        client.report(receipt, 0.5)
    worse, better = client.decisions(2)

    for row in (worse, better):
        evaluation = row["decision"]["evaluation"]
        assert evaluation["evaluator"] == "replay" and evaluation["baseline_scores"] == [0.5, 0.5]
    assert worse["decision"]["evaluation"]["scores"] == [0.0, 0.0]
    assert better["decision"]["evaluation"]["scores"] == [1.0, 1.0]
    consumed = {i for row in (worse, better) for i in row["consumed_ids"]}
    assert {r for r, _ in trained} <= consumed and not {r for r, _ in held} & consumed  # held out: never trained
    client.check_outcome(worse, better, held[0][1]["messages"])
