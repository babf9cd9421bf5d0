"""LoRA releases published into an SGLang server, over real HTTP, through the learner.

`reef serve +recipe=sao +sao_profile=tiny trainer.lora=true engine.kind=sglang` in front of FakeSGLang: two scenarios
each get their own adapter, loaded under versioned names; a scenario's requests carry its adapter's name and record
its own version line; a replaced adapter is unloaded once drained; a restarted Reef loads every head release again.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
import torch

from reef_core.commit.git_store import GitArtifactStore
from reef_core.models.adapter import AdapterWeights
from reef_core.versions import adapter_key
from reef_core.testing import FakeSGLang, ensure_tiny_model, serve_asgi, wait_until

reef_sao_tasks = pytest.importorskip("reef_sao.tasks")

pytestmark = pytest.mark.slow

BATCH = 4
PROBE = [{"role": "user", "content": "Say something short."}]


def _trained(server, scenario) -> list[dict]:
    rows = httpx.get(f"{server.url}/reef/scenarios/{scenario}/releases").json().get("releases", [])
    return [r for r in rows if r["operation"] == "training"]


def _step(server, client, scenario, tasks) -> None:
    """One step's rollouts, reported; waits for the learner to publish it and go idle."""
    before = len(_trained(server, scenario))
    for _ in range(BATCH):
        task = next(tasks)
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=task.messages(),
                                                               extra_headers={"x-reef-scenario": scenario})
        text = raw.parse().choices[0].message.content or ""
        report = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario},
                            json={"score": reef_sao_tasks.letter_share(task, text),
                                  "references": [raw.headers["x-reef-agent-record-id"]]})
        assert report.status_code == 200, report.text
    wait_until(lambda: len(_trained(server, scenario)) > before, timeout=120, what=f"a step of {scenario}")
    wait_until(lambda: httpx.get(f"{server.url}/reef/scenarios/{scenario}/status").json().get("learner") == "idle",
               timeout=120, what="an idle learner")


def _probe(server, client, scenario) -> dict:
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=PROBE, temperature=0,
                                                           extra_headers={"x-reef-scenario": scenario})
    record = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/"
                       f"{raw.headers['x-reef-agent-record-id']}").json()
    return record["payload"]["tokens"]


def _adapted_logprobs(app: FakeSGLang, files, tokens) -> torch.Tensor:
    """Log-probs of the recorded tokens under base + the release's adapter (peft), computed outside the server."""
    import copy

    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    from reef_core.models.loading import load_model

    adapter = AdapterWeights.from_files(files)
    model = get_peft_model(copy.deepcopy(load_model(app.model_dir)[0]), PeftConfig.from_peft_type(**adapter.config))
    set_peft_model_state_dict(model, dict(adapter.tensors))
    ids = torch.tensor([tokens["prompt_ids"] + tokens["output_ids"]])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[0, len(tokens["prompt_ids"]) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens["output_ids"])[:, None])[:, 0]


def _head_files(server, store, scenario):
    rows = httpx.get(f"{server.url}/reef/scenarios/{scenario}/releases").json()["releases"]
    return store.read_files(next(r for r in rows if r["current"])["release_id"])


def test_two_lora_scenarios_share_one_server_each_with_its_own_versioned_adapter(reef_server, tmp_path):
    model_dir = ensure_tiny_model(Path(os.environ["REEF_MODEL_CACHE"]) / "tiny")
    app = FakeSGLang(model_dir)
    key = {s: adapter_key(s) for s in ("lora-a", "lora-b")}
    with serve_asgi(app) as url:
        server = reef_server("+recipe=sao", "+sao_profile=tiny", "trainer.lora=true", "engine.kind=sglang",
                             f"engine.url={url}", "engine.seed=0", "seed=0", "trainer.checkpoint_every_n_versions=1")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        store = GitArtifactStore(server.data_dir / "artifacts.git", tmp_path / "reader")
        tasks = reef_sao_tasks.task_stream(seed=5)

        _step(server, client, "lora-a", tasks)
        _step(server, client, "lora-b", tasks)
        assert set(app.loaded_adapters()) == {f"{key['lora-a']}-v1", f"{key['lora-b']}-v1"}
        for scenario in ("lora-a", "lora-b"):
            tokens = _probe(server, client, scenario)
            assert tokens["version"].rpartition(":")[0].endswith(f".{key[scenario]}")  # its own version line
            assert app.log[-1]["body"]["lora_path"] == f"{key[scenario]}-v1"
            recorded = torch.tensor(tokens["output_logprobs"])
            assert torch.allclose(_adapted_logprobs(app, _head_files(server, store, scenario), tokens), recorded,
                                  atol=1e-4)

        _step(server, client, "lora-a", tasks)  # a new version: a new adapter name; the old one is unloaded
        wait_until(lambda: set(app.loaded_adapters()) == {f"{key['lora-a']}-v2", f"{key['lora-b']}-v1"},
                   timeout=30, what="the replaced adapter unloaded")

        incarnation = _probe(server, client, "lora-a")["version"].split(".")[0]
        server.restart()  # a new incarnation: leftovers unloaded, each head release loaded again
        for scenario in ("lora-a", "lora-b"):
            tokens = _probe(server, client, scenario)
            assert not tokens["version"].startswith(f"{incarnation}.") and tokens["version"].endswith(":1")
            recorded = torch.tensor(tokens["output_logprobs"])
            assert torch.allclose(_adapted_logprobs(app, _head_files(server, store, scenario), tokens), recorded,
                                  atol=1e-4)
        assert set(app.loaded_adapters()) == {f"{key['lora-a']}-v1", f"{key['lora-b']}-v1"}
