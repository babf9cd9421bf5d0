"""Shared fixtures: a FakeUpstream served in a background thread, and the tiny local model."""

from __future__ import annotations

import pytest

from reef_core.testing import FakeUpstream, serve_asgi

API_KEY = "sk-test-upstream"


@pytest.fixture(scope="module")
def fake_app():
    return FakeUpstream(api_key=API_KEY)


@pytest.fixture(scope="module")
def fake_server(fake_app):
    with serve_asgi(fake_app) as url:
        yield url


@pytest.fixture
def fake(fake_app, fake_server):
    """(app, url) with faults and counters reset for each test."""
    fake_app.reset()
    yield fake_app, fake_server
    fake_app.reset()


@pytest.fixture(scope="session")
def make_bf16_llama():
    """``make(path, seed)`` saves a tiny Llama whose float32 weights are all exact bf16 values (served from bf16
    packed copies, like SmolLM2) at ``path`` and returns it."""
    import torch

    from reef_core.grow.models import build_tiny_model, save_tokenizer

    def make(path, seed: int):
        model, tok = build_tiny_model(seed=seed, arch="llama", hidden_size=64, num_layers=2)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float() * 4)
        model.save_pretrained(path)
        save_tokenizer(tok, path)
        return path

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from reef_core.grow.models import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")



@pytest.fixture
def api_key():
    return API_KEY
