"""``POST /reef/scenarios/{s}/evaluate`` on weights releases of the tiny model over real HTTP: each LoRA release (and
the creation release, the base) answers on the private engine with its own weights while a later one serves, the
same greedy reply ``reef eval releases`` scores for it and the serving engine gives; nothing is recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
from safetensors.torch import save

from reef_core.background import serve_asgi
from reef_core.cli import main
from reef_core.commit.commitlog import CommitLog
from reef_core.commit.committer import Committer
from reef_core.commit.git_store import GitArtifactStore
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.models.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from reef_core.models.loading import ensure_tiny_model, load_model
from reef_core.serve.app import create_app
from reef_core.testing.adapters import random_adapter
from reef_core.testing.verifiers import reply_digest

SCENARIO, PROMPT = "w", "What is 2 + 3?"
OVERRIDES = ["engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=8", "recipe.name=w",
             "recipe.surface=weights"]


def _lora(base, seed: int) -> dict:
    weights = random_adapter(base, seed)[0]
    return {ADAPTER_CONFIG: json.dumps(weights.config).encode(),
            ADAPTER_WEIGHTS: save({k: v.contiguous() for k, v in weights.tensors.items()})}


def _chat(url: str, **more) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": SCENARIO}, timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **more})


def _eval_releases(data: Path, capsys) -> dict[str, float]:
    """``reef eval releases``' greedy score (a digest of the reply) of every release."""
    tasks = data.parent / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    code = main(["eval", "releases", "--scenario", SCENARIO, "--tasks", str(tasks), "--no-save",
                 f"storage.data_dir={data}", *OVERRIDES, "learn.verifier=python",
                 "+learn.verifier_options.path=reef_core.testing.verifiers:reply_digest"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return {row["release_id"]: row["scores"]["tasks"] for row in json.loads(out)["releases"]}


def test_weights_releases_answer_with_their_own_weights(tmp_path, capsys):
    data = tmp_path / "data"
    cfg = compose_config([*OVERRIDES, f"storage.data_dir={data}"])
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:  # the scenario and its base release
        assert _chat(url).status_code == 200
    store = GitArtifactStore(data / "artifacts.git", data / "artifacts-work")
    creation = store.head(SCENARIO)
    base = load_model(ensure_tiny_model(Path(os.environ["REEF_MODEL_CACHE"]) / "tiny"))[0]
    committer = Committer(store, CommitLog.for_scenario(data / "commits", SCENARIO), SCENARIO)
    first, _ = committer.publish(_lora(base, 1), expected_head=creation.release_id)
    second, _ = committer.publish(_lora(base, 2), expected_head=first.release_id)
    committer.log.close()
    scores = _eval_releases(data, capsys)
    ids = [creation.release_id, first.release_id, second.release_id]
    assert list(scores) == ids

    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:
        served = _chat(url, temperature=0)
        assert served.status_code == 200, served.text
        records = httpx.get(f"{url}/reef/scenarios/{SCENARIO}/records").json()["records"]
        replies = {}
        for release_id in (first.release_id, creation.release_id, second.release_id, first.release_id):
            answer = httpx.post(f"{url}/reef/scenarios/{SCENARIO}/evaluate", timeout=120, json={
                "release": release_id, "messages": [{"role": "user", "content": PROMPT}]})
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-reef-release-id"] == release_id and "x-reef-agent-record-id" not in answer.headers
            assert answer.json()["reef"]["surface"] == "weights"
            replies.setdefault(release_id, set()).add(answer.json()["choices"][0]["message"]["content"])
        assert all(len(texts) == 1 for texts in replies.values())  # the same content again: the same greedy reply
        text = {release_id: texts.pop() for release_id, texts in replies.items()}
        assert {release_id: reply_digest(text[release_id], {}) for release_id in ids} == scores
        assert len(set(text.values())) == 3  # the base and each adapter answer apart
        assert text[second.release_id] == served.json()["choices"][0]["message"]["content"]  # the head, as served
        assert httpx.get(f"{url}/reef/scenarios/{SCENARIO}/records").json()["records"] == records
