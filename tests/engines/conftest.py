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

    from reef_core.models.loading import build_tiny_model, save_tokenizer

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
    from reef_core.models.loading import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")



@pytest.fixture
def api_key():
    return API_KEY


@pytest.fixture(params=["avx512", "amx"])
def kernel_isa(request):
    """The C kernel's bf16 products on one path (each where this machine has it); the path in use is restored
    afterwards. The packed layout is the same on both, so packed weights serve either."""
    from reef_core.engines import kernels

    if kernels.kernel() is None:
        pytest.skip("no C compiler for the kernel")
    before = kernels.isa() == "amx"
    if request.param == "amx" and not kernels.use_amx(True):
        pytest.skip("no AMX on this machine")
    if request.param == "avx512":
        kernels.use_amx(False)
        if kernels.isa() != "avx512":
            pytest.skip("no AVX-512 on this machine")
    yield request.param
    kernels.use_amx(before)

