"""Two training recipes in one deployment, each with its own composition and gate, over real HTTP.

``math-*`` scenarios are routed to ``duo_weights`` (the torch backend training the tiny model's weights with a
REINFORCE objective, gated by ``always``, with a route override of its learning rate); ``support-*`` to
``duo_harness`` (a harness prompt injected as the system prompt, gated by ``floor`` with a floor no candidate
reaches). The top level asks for ``evaluation.publish=review``: it is the default recipe's section, so it must
reach neither routed recipe. Driven with the openai SDK against an in-process server on loopback.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from reef_core import hookimpl
from reef_core.config import compose_config
from reef_core.grow.objective import Objective, Prepared, sequence_logprobs, token_sum
from reef_core.grow.trainer import CandidateUpdate, Trainer
from reef_core.loop.assemble import build_deployment
from reef_core.plugins import PluginManager
from reef_core.serve.app import create_app
from reef_core.testing.fake_upstream import serve_asgi
from reef_core.testing.fixtures import wait_until

pytest.importorskip("torch")

RECIPES = Path(__file__).resolve().parents[1] / "fixtures" / "duo-recipes"
#: scenario -> the ``trainer`` section its trainer factory received.
SECTIONS: dict[str, object] = {}


class Reinforce(Objective):
    """``-Σ reward·logπ / tokens`` over the action tokens: the smallest objective that moves the weights."""

    name = "reinforce"

    def prepare(self, policy, batch):
        return Prepared(batch=batch.with_extras(advantages=batch.rewards.unsqueeze(1) * batch.action_mask))

    def loss(self, policy, batch, prepared):
        mask = batch.action_mask > 0
        logp = sequence_logprobs(policy, batch)
        return -token_sum(batch.extras["advantages"] * logp, mask) / batch.norm_tokens, {}


class PromptTrainer(Trainer):
    """Seeds ``system_prompt.md`` and proposes a new one per batch."""

    artifact_kind = "harness"
    SEED = "You help with support questions."

    def __init__(self):
        self.calls = 0

    def initial_files(self):
        return {"system_prompt.md": self.SEED.encode()}

    def train(self, batch, ctx):
        self.calls += 1
        return CandidateUpdate(files={"system_prompt.md": f"Support prompt, version {self.calls}.".encode()})


class DuoPlugin:
    @staticmethod
    @hookimpl
    def reef_config_searchpath():
        return f"file://{RECIPES}"

    @staticmethod
    @hookimpl
    def reef_register_trainers(register):
        from reef_core.grow.torch_backend import TorchTrainer

        def torch_trainer(*, scenario, trainer, context, **_):
            SECTIONS[scenario] = trainer
            return TorchTrainer.from_config(Reinforce(), context, trainer, who="duo_torch", name="duo_torch")

        def prompt_trainer(*, scenario, trainer, **_):
            SECTIONS[scenario] = trainer
            return PromptTrainer()

        register("duo_torch", torch_trainer)
        register("duo_prompts", prompt_trainer)


ROUTES = ("routes=[{pattern: 'math-*', recipe: duo_weights, overrides: ['trainer.lr=0.002']},"
          " {pattern: 'support-*', recipe: duo_harness}]")


def _commits(url: str, scenario: str) -> list[dict]:
    return httpx.get(f"{url}/reef/scenarios/{scenario}/commits").json()["commits"]


def _step(url: str, client: openai.OpenAI, scenario: str, rows: int) -> list[dict]:
    """One chat and one report quoting it; wait for the commit log to hold ``rows`` rows and the learner to rest."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "how do I reset my password?"}],
        extra_headers={"x-reef-scenario": scenario})
    receipt = raw.headers["x-reef-agent-record-id"]
    report = httpx.post(f"{url}/reef/report", headers={"x-reef-scenario": scenario},
                        json={"score": 1.0, "references": [receipt]})
    assert report.status_code == 200, report.text
    found = wait_until(lambda: (c := _commits(url, scenario)) and len(c) >= rows and c, timeout=120,
                       what=f"{rows} commit rows of {scenario}")
    wait_until(lambda: httpx.get(f"{url}/reef/scenarios/{scenario}/status").json()["learner"] == "idle",
               timeout=120)
    return found


def test_each_routed_recipe_trains_with_its_own_sections_and_gate(tmp_path):
    SECTIONS.clear()
    pm = PluginManager(load_entry_points=False, extra_plugins=(DuoPlugin,))
    cfg = compose_config(["engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=4", "engine.seed=0",
                          f"storage.data_dir={tmp_path}", "evaluation.publish=review", ROUTES], pm)
    dep = build_deployment(cfg, pm)
    with serve_asgi(create_app(dep), lifespan="on") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        math = _step(url, client, "math-1", 2)
        support = _step(url, client, "support-1", 2)
        math = _step(url, client, "math-1", 3)

        # Each trainer factory received its own recipe's trainer section: the route override, the recipe default.
        assert SECTIONS["math-1"].lr == pytest.approx(0.002)
        assert SECTIONS["support-1"].lr == pytest.approx(1.0e-6)

        # math-1: every candidate decided by `always`, published at once (the top level's `review` is not its own).
        assert [row["operation"] for row in math] == ["creation", "training", "training"]
        for row in math[1:]:
            assert row["decision"]["policy"] == "always" and row["decision"]["decision"] == "select"
            assert row["release_id"]
        releases = httpx.get(f"{url}/reef/scenarios/math-1/releases").json()["releases"]
        assert not any(r["pending"] for r in releases)
        assert next(r for r in releases if r["current"])["release_id"] == math[-1]["release_id"]
        status = httpx.get(f"{url}/reef/scenarios/math-1/status").json()
        assert status["recipe"] == "duo_weights" and status["counters"]["selected"] == 2
        assert status["gate"] == {"policy": "always", "evaluator": None, "publish": "auto", "rollout": "immediate"}
        assert status["current_version"].endswith(":2")  # two weight swaps served

        # support-1: its candidate decided by `floor` (nothing reaches 2.0) and rejected; the seed still serves.
        assert support[0]["operation"] == "creation"
        assert support[1]["release_id"] is None
        assert support[1]["decision"]["policy"] == "floor" and support[1]["decision"]["decision"] == "reject"
        status = httpx.get(f"{url}/reef/scenarios/support-1/status").json()
        assert status["recipe"] == "duo_harness" and status["counters"]["rejected"] == 1
        assert status["gate"] == {"policy": "floor", "evaluator": None, "publish": "auto", "rollout": "immediate"}
        assert status["current_release_id"] == support[0]["release_id"]

        # Each recipe's surface options hold: support requests carry the injected harness, math requests do not.
        def system_prompts(scenario):
            stored = [r for r in dep.store.replay(scenario) if r.kind == "inference"]
            assert stored
            return [m["content"] for r in stored for m in r.payload["request"]["messages"] if m["role"] == "system"]

        assert system_prompts("support-1") == [PromptTrainer.SEED]
        assert system_prompts("math-1") == []
