"""The packed weights the local engine keeps on disk (reef_core/engines/packcache.py): a second start adopts what the
first start packed, without packing, and serves the same tokens and log-probs; a changed weight file or a damaged
cache file is packed afresh (and the file rewritten); a model under the size floor gets no file."""

from __future__ import annotations

import asyncio
import os

import pytest

from reef_core.engines import kernels, packcache
from reef_core.engines.base import EngineRequest
from reef_core.engines.local import LocalEngine

pytestmark = pytest.mark.skipif(kernels.kernel() is None, reason="no C compiler for the kernel")

BODY = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}], "seed": 7,
        "temperature": 1.0, "max_tokens": 12}


@pytest.fixture
def model_dir(tmp_path, make_bf16_llama):
    return make_bf16_llama(tmp_path / "tiny-llama-bf16", seed=4)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Packed files under tmp_path, and no size floor (the tiny model's copies are a few hundred KB)."""
    monkeypatch.setattr(packcache, "cache_dir", lambda: tmp_path / "packed")
    monkeypatch.setattr(packcache, "MIN_BYTES", 0)
    return tmp_path / "packed"


@pytest.fixture
def packs(monkeypatch):
    """How many weights were packed (reordered from the model's float32) since the test began."""
    count = [0]
    init = kernels.PackedMatrix.__init__

    def counting(self, w, fn):
        count[0] += 1
        init(self, w, fn)

    monkeypatch.setattr(kernels.PackedMatrix, "__init__", counting)
    return count


def _serve(model_dir):
    async def go():
        async with LocalEngine(model_dir, top_k_logprobs=3) as eng:
            res = await eng.complete(EngineRequest("openai", "chat", dict(BODY), {}))
            assert eng.decode_path == "lean"
            return res.tokens, len(eng._packed)

    return asyncio.run(go())


def test_a_second_start_adopts_the_packed_weights_the_first_start_wrote(model_dir, cache, packs):
    first, bf16_first = _serve(model_dir)
    assert packs[0] == 15  # 2 layers x 7 projections + the (tied) head
    assert packcache.cache_path(model_dir).is_file()
    packs[0] = 0
    second, bf16_second = _serve(model_dir)
    assert packs[0] == 0
    assert bf16_second == bf16_first == 15
    assert second.output_ids == first.output_ids and len(second.output_ids) > 3
    assert second.output_logprobs == first.output_logprobs  # bitwise: the same packed bytes
    assert second.top_k.logprobs == first.top_k.logprobs


def test_a_changed_weight_file_is_packed_afresh(model_dir, cache, packs):
    first, _ = _serve(model_dir)
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    packs[0] = 0
    again, _ = _serve(model_dir)
    assert packs[0] == 15
    assert again.output_ids == first.output_ids
    packs[0] = 0
    _serve(model_dir)  # the file was rewritten for the changed weights
    assert packs[0] == 0


def test_a_damaged_cache_file_is_packed_afresh_and_rewritten(model_dir, cache, packs):
    first, _ = _serve(model_dir)
    packcache.cache_path(model_dir).write_bytes(b"not a safetensors file")
    packs[0] = 0
    again, _ = _serve(model_dir)
    assert packs[0] == 15 and again.output_ids == first.output_ids
    packs[0] = 0
    _serve(model_dir)
    assert packs[0] == 0


def test_a_small_model_gets_no_file(model_dir, cache, monkeypatch):
    monkeypatch.setattr(packcache, "MIN_BYTES", 16 << 20)
    _serve(model_dir)
    assert not packcache.cache_path(model_dir).exists()
