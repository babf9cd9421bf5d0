"""SAO learns through `engine.kind=sglang`: `reef serve +recipe=sao +sao_profile=tiny` in front of FakeSGLang (a real
tiny model behind SGLang's HTTP routes, in its own process), with the margin of the embedded-engine test. Every
training step is published into the server with update_weights_from_disk under the release's version."""

from __future__ import annotations

import functools
import importlib.util
import os
import statistics
from pathlib import Path

import httpx
import pytest

from reef_core.testing import ensure_tiny_model, learn_in_rounds, serve_fake_sglang

pytestmark = pytest.mark.slow

_CLIENT = Path(__file__).resolve().parents[1] / "examples" / "client.py"


def _example_client():
    spec = importlib.util.spec_from_file_location("reef_sao_example_client_sglang", _CLIENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sao_learns_over_http_through_sglang(reef_server):
    model_dir = ensure_tiny_model(Path(os.environ["REEF_MODEL_CACHE"]) / "tiny")  # what engine.model=tiny resolves to
    # A server in its own process generates faster than the embedded engine, which shares Reef's CPU with the
    # learner: rounds that wait for the learner keep the steps per rollout what the embedded-engine test sees.
    with serve_fake_sglang(model_dir, mode="process") as sglang_url:
        server = reef_server("+recipe=sao", "+sao_profile=tiny", "engine.kind=sglang", f"engine.url={sglang_url}",
                             "engine.seed=0", "seed=0")
        # Scored by the letter share, as the loop's other plumbing tests: under the repetition-proof verifier the
        # tiny model rose only 0.247 -> 0.312 once; what is tested is the SGLang engine's path.
        from reef_sao.tasks import letter_share

        run = functools.partial(_example_client().run, verifier=letter_share)
        rewards = learn_in_rounds(run, server.url, "vowels")
        first, last = statistics.mean(rewards[:48]), statistics.mean(rewards[-48:])
        assert last >= 0.2 and last - first >= 0.1, (first, last)
        print(f"sao over http through sglang: {first:.3f} -> {last:.3f}")

        trained = [r for r in httpx.get(f"{server.url}/reef/scenarios/vowels/releases").json()["releases"]
                   if r["operation"] == "training"]
        assert len(trained) >= 10
        status = httpx.get(f"{server.url}/reef/scenarios/vowels/status").json()
        assert status["last_error"] is None and status["counters"]["selected"] >= 10
        # The server serves a published release under the version Reef gave it (<incarnation>:<publishes>).
        served = httpx.get(f"{sglang_url}/model_info").json()["weight_version"]
        published = len([r for r in httpx.get(f"{server.url}/reef/scenarios/vowels/releases").json()["releases"]
                         if r["operation"] == "training"])
        assert 10 <= int(served.rsplit(":", 1)[1]) <= published, (served, published)
