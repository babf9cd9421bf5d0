"""LocalEngine with engine.top_k_logprobs: per-token top-K ids and log-probs, captured during generation."""

from __future__ import annotations

import asyncio

import pytest
import torch

from reef_core.engines.base import TOKENS_EVENT, EngineRequest, TokenData
from reef_core.engines.local import LocalEngine
from reef_core.errors import ConfigError

MESSAGES = [{"role": "user", "content": "Count to ten, please."}]


def _req(**body):
    return EngineRequest("openai", "chat", {"model": "tiny", "messages": MESSAGES, **body}, {})


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    from reef_core.models.loading import load_model

    return load_model(tiny_model_dir)


def _full_forward_log_softmax(model, prompt_ids, output_ids):
    """log_softmax at every output position from one cache-free forward pass (the reference)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)


def test_top_k_matches_a_separate_full_forward_pass(tiny_model_dir, ref):
    async def go():
        async with LocalEngine(tiny_model_dir, max_new_tokens=24, top_k_logprobs=20) as eng:
            return await eng.complete(_req(seed=3, temperature=0.9, top_p=0.9, max_tokens=24))

    t = asyncio.run(go()).tokens
    assert t.top_k is not None and t.top_k.k == 20 and t.top_k.tokens == len(t.output_ids) > 1
    lp = _full_forward_log_softmax(ref[0], t.prompt_ids, t.output_ids)
    ref_vals, ref_ids = torch.topk(lp, 20, dim=-1)
    for i in range(len(t.output_ids)):
        ids, vals = t.top_k.row(i)
        assert torch.allclose(torch.tensor(vals), ref_vals[i], atol=1e-4)
        # Ties aside, the ids are the reference's: compare them as the log-probs they select.
        assert torch.allclose(lp[i, torch.tensor(ids)], ref_vals[i], atol=1e-4)
        assert vals == sorted(vals, reverse=True)
        # The sampled token's log-prob agrees with its entry in the top-K whenever it is there, and never
        # exceeds the K-th value when it is not.
        tid, own = t.output_ids[i], t.output_logprobs[i]
        if tid in ids:
            assert abs(vals[ids.index(tid)] - own) < 1e-5
        else:
            assert own <= vals[-1] + 1e-6
        assert abs(own - float(lp[i, tid])) < 1e-4


def test_stream_carries_the_same_top_k(tiny_model_dir):
    async def go():
        async with LocalEngine(tiny_model_dir, max_new_tokens=12, top_k_logprobs=5) as eng:
            done = await eng.complete(_req(seed=11, max_tokens=12))
            events = [ev async for ev in eng.stream(_req(seed=11, max_tokens=12, stream=True))]
            return done.tokens, events

    plain, events = asyncio.run(go())
    streamed = TokenData.from_dict(next(ev.data for ev in events if ev.event == TOKENS_EVENT))
    assert streamed.top_k is not None and streamed.top_k.k == 5
    assert streamed.output_ids == plain.output_ids and streamed.top_k.ids == plain.top_k.ids
    assert streamed.top_k.logprobs == pytest.approx(plain.top_k.logprobs, abs=1e-5)


def test_k_zero_captures_nothing(tiny_model_dir):
    async def go():
        async with LocalEngine(tiny_model_dir, max_new_tokens=8) as eng:
            return await eng.complete(_req(seed=1))

    t = asyncio.run(go()).tokens
    assert t.top_k is None and "top_k" not in t.to_event()


@pytest.mark.parametrize("bad", [-1, 65, True, 2.0])
def test_bad_top_k_logprobs_is_a_config_error(tiny_model_dir, bad):
    with pytest.raises(ConfigError, match="top_k_logprobs"):
        LocalEngine(tiny_model_dir, top_k_logprobs=bad)
