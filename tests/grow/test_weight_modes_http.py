"""Weight scenarios sharing one engine, over real HTTP: LoRA scenarios learn apart; full weights stay alone.

Two LoRA scenarios given opposite rewards for the same reply move their own adapters in opposite directions.

``full-*`` scenarios train every weight (``duo_weights``), ``lora-*`` scenarios a LoRA adapter (``duo_lora``). The
engine has one set of base weights: once a full-weight scenario owns them, a LoRA scenario cannot put an adapter
on top (the next full swap would move its base), so it serves and records but does not train, and its status
says why and how to fix it; the full-weight scenario keeps training.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.plugins import PluginManager
from reef_core.serve.app import create_app
from reef_core.testing.fake_upstream import serve_asgi
from reef_core.testing.fixtures import wait_until

from .test_two_recipes_http import DuoPlugin, _step

pytest.importorskip("peft")

ROUTES = "routes=[{pattern: 'full-*', recipe: duo_weights}, {pattern: 'lora-*', recipe: duo_lora}]"


def _status(url: str, scenario: str) -> dict:
    return httpx.get(f"{url}/reef/scenarios/{scenario}/status").json()


def test_a_lora_scenario_beside_a_full_weight_owner_serves_without_training(tmp_path):
    pm = PluginManager(load_entry_points=False, extra_plugins=(DuoPlugin,))
    cfg = compose_config(["engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=4", "engine.seed=0",
                          f"storage.data_dir={tmp_path}", ROUTES], pm)
    dep = build_deployment(cfg, pm)
    with serve_asgi(create_app(dep), lifespan="on") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        full = _step(url, client, "full-1", 2)
        assert [row["operation"] for row in full] == ["creation", "training"]

        # The LoRA scenario: its request is served and recorded (a receipt), but it never trains.
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], extra_headers={"x-reef-scenario": "lora-1"})
        assert raw.headers["x-reef-agent-record-id"]
        status = wait_until(lambda: (s := _status(url, "lora-1")).get("training_disabled") and s, timeout=60,
                            what="lora-1 reports why it does not train")
        reason = status["training_disabled"]
        assert "full-1" in reason and "lora-1" in reason and "another deployment" in reason, reason
        report = httpx.post(f"{url}/reef/report", headers={"x-reef-scenario": "lora-1"},
                            json={"score": 1.0, "references": [raw.headers["x-reef-agent-record-id"]]})
        assert report.status_code == 200, report.text
        assert _status(url, "lora-1")["counters"].get("selected", 0) == 0

        # The full-weight owner is unaffected: it trains again and its version moves on.
        full = _step(url, client, "full-1", 3)
        assert full[-1]["decision"]["decision"] == "select"
        assert _status(url, "full-1")["current_version"].endswith(":2")
        assert _status(url, "full-1").get("training_disabled") is None


LORA_ROUTES = "routes=[{pattern: 'lora-*', recipe: duo_lora, overrides: ['trainer.lr=0.005']}]"
PROBE = [{"role": "user", "content": "how do I reset my password?"}]


def _reply_logprob(dep, scenario: str, tokens: dict) -> float:
    """Sum of the log-probs the served engine gives ``tokens``' reply under ``scenario``'s serving adapter.

    Scored directly (the engine is idle here): enable the adapter the scenario's serving version names, then one
    forward pass over prompt + reply."""
    import torch

    engine = dep.engine
    with torch.no_grad():
        engine._serve_as(dep.serving_version(dep._scenarios[scenario]))
        ids = torch.tensor([tokens["prompt_ids"] + tokens["output_ids"]])
        logits = engine._model(input_ids=ids).logits[0, len(tokens["prompt_ids"]) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens["output_ids"])[:, None])
    return float(lp.sum())


def test_two_lora_scenarios_move_their_own_adapters_in_opposite_directions(tmp_path):
    """The same reply, rewarded +1 in one scenario and -1 in the other: after one step each, the rewarded
    scenario's adapter makes that reply more likely than the base does, the punished one less likely, and each
    scenario's requests are recorded on its own adapter line."""
    pm = PluginManager(load_entry_points=False, extra_plugins=(DuoPlugin,))
    cfg = compose_config(["engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=6", "engine.seed=0",
                          f"storage.data_dir={tmp_path}", LORA_ROUTES], pm)
    dep = build_deployment(cfg, pm)
    with serve_asgi(create_app(dep), lifespan="on") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        receipts, tokens = {}, {}
        for scenario in ("lora-up", "lora-down"):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=PROBE, temperature=0, extra_headers={"x-reef-scenario": scenario})
            receipts[scenario] = raw.headers["x-reef-agent-record-id"]
            detail = httpx.get(f"{url}/reef/scenarios/{scenario}/records/{receipts[scenario]}").json()
            tokens[scenario] = detail["payload"]["tokens"]
        assert tokens["lora-up"]["output_ids"] == tokens["lora-down"]["output_ids"]  # both greedy on the base
        reply = tokens["lora-up"]
        base = _reply_logprob(dep, "lora-up", reply)

        for scenario, score in (("lora-up", 1.0), ("lora-down", -1.0)):
            report = httpx.post(f"{url}/reef/report", headers={"x-reef-scenario": scenario},
                                json={"score": score, "references": [receipts[scenario]]})
            assert report.status_code == 200, report.text
        for scenario in ("lora-up", "lora-down"):
            wait_until(lambda s=scenario: len(httpx.get(f"{url}/reef/scenarios/{s}/commits").json()["commits"]) >= 2
                       and _status(url, s)["learner"] == "idle", timeout=120, what=f"{scenario} trained one step")

        up, down = _reply_logprob(dep, "lora-up", reply), _reply_logprob(dep, "lora-down", reply)
        assert up > base + 0.05 and down < base - 0.05, (base, up, down)
        versions = {s: _status(url, s)["current_version"] for s in ("lora-up", "lora-down")}
        assert versions["lora-up"] != versions["lora-down"]
        assert all(v.endswith(":1") for v in versions.values()), versions  # each line counts only its own update
