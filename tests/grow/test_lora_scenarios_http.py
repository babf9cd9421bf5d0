"""Two LoRA scenarios on one base model, over real HTTP: each trains its own adapter on its own reward, and every
request is served (and recorded) by its scenario's adapter, never the other's.

A real `reef serve +recipe=sao +sao_profile=tiny trainer.lora=true` process, the openai SDK, real git releases;
the recorded log-probs are recomputed outside the server from the base model plus the release's adapter (peft).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from reef_core.commit.git_store import GitArtifactStore
from reef_core.models.adapter import AdapterWeights
from reef_core.models.loading import load_model

reef_sao_tasks = pytest.importorskip("reef_sao.tasks")

pytestmark = pytest.mark.slow

PROBE = [{"role": "user", "content": "Say something short."}]


def _releases(server, scenario):
    response = httpx.get(f"{server.url}/reef/scenarios/{scenario}/releases")
    return response.json()["releases"] if response.status_code == 200 else []


def _trained(server, scenario):
    return [r for r in _releases(server, scenario) if r["operation"] == "training"]


def _probe(server, client, scenario):
    """A greedy request of the scenario: the tokens its record stores (version, ids, log-probs)."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=PROBE, temperature=0,
                                                           extra_headers={"x-reef-scenario": scenario})
    record_id = raw.headers["x-reef-agent-record-id"]
    detail = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{record_id}").json()
    assert detail["artifact_ref"] == detail["payload"]["tokens"]["version"]
    return detail["payload"]["tokens"]


def _train(server, client, scenario, reward, releases, deadline, seed):
    """Chat and report until ``scenario`` has ``releases`` training releases."""
    tasks = reef_sao_tasks.task_stream(seed=seed)
    while len(_trained(server, scenario)) < releases:
        assert time.monotonic() < deadline, server.log()
        task = next(tasks)
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=task.messages(),
                                                               extra_headers={"x-reef-scenario": scenario})
        text = raw.parse().choices[0].message.content or ""
        report = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario},
                            json={"score": reward(task, text), "references": [raw.headers["x-reef-agent-record-id"]]})
        assert report.status_code == 200, report.text


def _recomputed(model, tokens):
    ids = torch.tensor([tokens["prompt_ids"] + tokens["output_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(tokens["prompt_ids"]) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, torch.tensor(tokens["output_ids"])[:, None])[:, 0]


def _with_adapter(base_dir, files):
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    adapter = AdapterWeights.from_files(files)
    model, _ = load_model(base_dir)
    model = get_peft_model(model, PeftConfig.from_peft_type(**adapter.config))
    set_peft_model_state_dict(model, dict(adapter.tensors))
    return model.eval()


def test_two_lora_scenarios_learn_independently_each_served_by_its_own_adapter(reef_server, tmp_path):
    server = reef_server("+recipe=sao", "+sao_profile=tiny", "engine.seed=0", "seed=0", "trainer.lora=true",
                         "trainer.checkpoint_every_n_versions=1")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 150
    base_dir = Path(os.environ["REEF_MODEL_CACHE"]) / "tiny"
    base, _ = load_model(base_dir)
    base.eval()

    b_before, a_before = _probe(server, client, "lora-b"), _probe(server, client, "lora-a")
    assert a_before["version"] == b_before["version"] and a_before["version"].endswith(":0")  # both on the base

    # A trains on its reward (vowels); B, which never trained, is served exactly as before
    _train(server, client, "lora-a", reef_sao_tasks.letter_share, 2, deadline, seed=1)
    b_after_a = _probe(server, client, "lora-b")
    assert b_after_a["version"] == b_before["version"]
    assert b_after_a["output_ids"] == b_before["output_ids"]
    assert b_after_a["output_logprobs"] == pytest.approx(b_before["output_logprobs"], abs=1e-5)
    assert torch.allclose(_recomputed(base, b_after_a), torch.tensor(b_after_a["output_logprobs"]), atol=2e-3)

    # B trains on the opposite reward
    _train(server, client, "lora-b", lambda task, text: 1.0 - reef_sao_tasks.letter_share(task, text), 1, deadline,
           seed=2)

    incarnation = b_before["version"].rpartition(":")[0]
    store = GitArtifactStore(server.data_dir / "artifacts.git", tmp_path / "reader")
    lines = {}
    for scenario in ("lora-a", "lora-b"):
        tokens = _probe(server, client, scenario)
        line, _, seq = tokens["version"].rpartition(":")
        # its own version line: the engine's incarnation plus the scenario's key, counting only its own updates
        assert line.startswith(f"{incarnation}.") and int(seq) >= 1, tokens["version"]
        lines[scenario] = line
        release_id = next(r["release_id"] for r in _releases(server, scenario)
                          if tokens["version"] in r["metrics"].get("serving_versions", []))
        adapted = _with_adapter(base_dir, store.read_files(release_id))
        recorded = torch.tensor(tokens["output_logprobs"])
        # served by base + this scenario's adapter: its log-probs, not the base's
        assert torch.allclose(_recomputed(adapted, tokens), recorded, atol=2e-3), scenario
        assert not torch.allclose(_recomputed(base, tokens), recorded, atol=1e-4), scenario
    assert lines["lora-a"] != lines["lora-b"]

    for scenario in ("lora-a", "lora-b"):
        status = httpx.get(f"{server.url}/reef/scenarios/{scenario}/status").json()
        assert status["training_disabled"] is None and status["last_error"] is None, status
        assert status["counters"]["selected"] >= 1
