"""Full-weight releases published into a vLLM server, over real HTTP, through the learner.

A real `reef serve +recipe=sao +sao_profile=tiny engine.kind=vllm` process in front of FakeVLLM (a real tiny model
behind vLLM's routes, served from this test process so a failure can be injected): a training step's release is
reloaded into the server, an injected ``reload_weights`` failure leaves the previous release serving and the head
restored to it (the core's activation rule), and a restarted Reef loads the head release into the server again under
its new incarnation. (The SAO learning margin is checked through SGLang only: the engines share that code.)
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load as load_safetensors

from reef_core.commit.git_store import GitArtifactStore
from reef_core.engines.untie import untied_copy
from reef_core.testing import FakeVLLM, ensure_tiny_model, serve_asgi, wait_until

reef_sao_tasks = pytest.importorskip("reef_sao.tasks")

pytestmark = pytest.mark.slow

SCENARIO = "weights"
BATCH = 4  # the tiny profile's recipe.options.batch_size


def _round(server, client, tasks) -> None:
    """One training step's worth of rollouts, each reported."""
    for _ in range(BATCH):
        task = next(tasks)
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=task.messages())
        text = raw.parse().choices[0].message.content or ""
        report = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": SCENARIO},
                            json={"score": reef_sao_tasks.letter_share(task, text),
                                  "references": [raw.headers["x-reef-agent-record-id"]]})
        assert report.status_code == 200, report.text


def _commits(server) -> list[dict]:
    rows = httpx.get(f"{server.url}/reef/scenarios/{SCENARIO}/commits").json()["commits"]
    return [r for r in rows if r["operation"] != "creation"]


def _settled(server, rows: int) -> list[dict]:
    commits = wait_until(lambda: (lambda c: c if len(c) >= rows else None)(_commits(server)), timeout=120,
                         what=f"{rows} commits")
    wait_until(lambda: _status(server).get("learner") == "idle", timeout=120, what="an idle learner")
    return commits


def _status(server) -> dict:
    return httpx.get(f"{server.url}/reef/scenarios/{SCENARIO}/status").json()


def _head(server) -> dict:
    rows = httpx.get(f"{server.url}/reef/scenarios/{SCENARIO}/releases").json()["releases"]
    return next(r for r in rows if r["current"])


def _serves(app: FakeVLLM, files: dict) -> bool:
    """Whether the fake's model holds exactly the release's weights."""
    release = load_safetensors(files["model.safetensors"])
    own = app.model.state_dict()
    return all(torch.equal(own[k], v.to(own[k].dtype)) for k, v in release.items() if k in own)


def test_failed_update_keeps_the_old_release_and_a_restart_reloads_the_head(reef_server, tmp_path):
    model_dir = ensure_tiny_model(Path(os.environ["REEF_MODEL_CACHE"]) / "tiny")  # what engine.model=tiny names
    # Served as Reef's untied copy, as engine.launch serves a model that ties its embeddings (engines/untie.py).
    app = FakeVLLM(untied_copy(model_dir, tmp_path / "tiny-untied"))
    with serve_asgi(app) as url:
        overrides = ("+recipe=sao", "+sao_profile=tiny", "engine.kind=vllm", f"engine.url={url}", "engine.seed=0",
                     "seed=0", "trainer.checkpoint_every_n_versions=1")
        server = reef_server(*overrides)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               default_headers={"x-reef-scenario": SCENARIO})
        tasks = reef_sao_tasks.task_stream(seed=3)
        store = GitArtifactStore(server.data_dir / "artifacts.git", tmp_path / "reader")

        _round(server, client, tasks)
        _settled(server, 1)
        good = _head(server)
        incarnation = app.weight_version.rpartition(":")[0]
        assert app.weight_version == f"{incarnation}:1" and _status(server)["current_version"] == app.weight_version
        assert _serves(app, store.read_files(good["release_id"]))

        app.add_fault("reload_weights", after_load=True)  # fails after the weights moved
        _round(server, client, tasks)
        commits = _settled(server, 3)
        assert [c["operation"] for c in commits] == ["training", "training", "restore"]
        head = _head(server)
        assert head["operation"] == "restore" and head["content_id"] == good["content_id"]
        # The failed release never served; the restored head serves again, with the good release's weights.
        assert app.snapshot()["pending_faults"] == [] and app.paused is None
        assert _status(server)["current_version"] == app.weight_version
        assert _serves(app, store.read_files(head["release_id"]))
        probe = client.chat.completions.with_raw_response.create(model="tiny", messages=[
            {"role": "user", "content": "Say something short."}], temperature=0)
        record = httpx.get(f"{server.url}/reef/scenarios/{SCENARIO}/records/"
                           f"{probe.headers['x-reef-agent-record-id']}").json()
        assert record["payload"]["tokens"]["version"] == app.weight_version

        server.restart()  # a new incarnation: the head release is loaded into the server again
        status = wait_until(lambda: (lambda s: s if s.get("current_version") else None)(_status(server)), timeout=60)
        assert status["current_release_id"] == head["release_id"]
        assert not status["current_version"].startswith(f"{incarnation}:")
        assert app.weight_version == status["current_version"]
        assert _serves(app, store.read_files(head["release_id"]))
