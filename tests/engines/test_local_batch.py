"""LocalEngine's continuous batching (engine.max_batch_size): concurrent requests decoded together give what each
gives alone, with the trainer's log-probs; a weight swap or an adapter change waits for the batch to drain."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from reef_core.engines.base import EngineRequest
from reef_core.engines.kernels import PackedMatrix, kernel
from reef_core.engines.local import LocalEngine
from reef_core.errors import ConfigError
from reef_core.models.loading import load_model

from reef_core.testing.adapters import random_adapter

# eight requests of different lengths and sampling parameters (one with a stop string, two greedy, one nucleus)
BODIES = [
    {"messages": [{"role": "user", "content": "Tell me about the sea " * (1 + i)}], "seed": 10 + i,
     "max_tokens": 6 + 3 * i, "temperature": [1.0, 0.0, 0.7, 1.3][i % 4], "top_p": 0.8 if i == 5 else 1.0,
     **({"stop": ["e"]} if i == 6 else {})}
    for i in range(8)
]


def _req(body, version=None):
    return EngineRequest("openai", "chat", {"model": "m", **body}, {}, version=version)


async def _hold(eng: LocalEngine):
    """Block the worker with a call until the returned event is set, so what is queued meanwhile starts together."""
    gate = threading.Event()
    held = asyncio.wrap_future(eng._worker.call(gate.wait))
    return gate, held


async def _batched_and_alone(model_dir, bodies, **kw):
    async with LocalEngine(model_dir, top_k_logprobs=3, **kw) as eng:
        gate, held = await _hold(eng)
        tasks = [asyncio.ensure_future(eng.complete(_req(b))) for b in bodies]
        await asyncio.sleep(0)  # every request queued behind the gate
        gate.set()
        await held
        batched = await asyncio.gather(*tasks)
        rows = eng.stats["max_rows"]
        alone = [await eng.complete(_req(b)) for b in bodies]
        return batched, alone, rows


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, make_bf16_llama):
    return make_bf16_llama(tmp_path_factory.mktemp("models") / "tiny-llama-bf16", seed=3)


def _logprobs(model, prompt_ids, output_ids):
    """The trainer's view: log-probs of ``output_ids`` after ``prompt_ids`` in one forward, and the full rows."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp[torch.arange(len(output_ids)), torch.tensor(output_ids)], lp


@pytest.mark.parametrize("which", ["qwen2", "llama-bf16"])
def test_eight_concurrent_requests_give_what_each_gives_alone(which, tiny_model_dir, bf16_dir):
    model_dir = tiny_model_dir if which == "qwen2" else bf16_dir
    batched, alone, rows = asyncio.run(_batched_and_alone(model_dir, BODIES))
    assert rows == sum(len(b.tokens.output_ids) > 1 for b in batched) >= 6  # all that went on shared each step
    model, _ = load_model(model_dir)
    assert batched[6].tokens.output_ids and batched[6].body["choices"][0]["finish_reason"] == "stop"
    for b, a, body in zip(batched, alone, BODIES):
        bt, at = b.tokens, a.tokens
        assert bt.output_ids == at.output_ids, body  # same seed, same tokens: batching changes no draw
        assert len(bt.output_ids) <= body["max_tokens"]
        assert b.body["choices"][0]["message"]["content"] == a.body["choices"][0]["message"]["content"]
        assert torch.allclose(torch.tensor(bt.output_logprobs), torch.tensor(at.output_logprobs), atol=1e-5, rtol=0)
        expected, full = _logprobs(model, bt.prompt_ids, bt.output_ids)  # the trainer's recomputation
        assert torch.allclose(torch.tensor(bt.output_logprobs), expected, atol=1e-4, rtol=0)
        assert torch.allclose(torch.tensor(bt.top_k.logprobs).view(-1, 3), full.topk(3).values, atol=1e-4, rtol=0)
    if kernel() is not None:  # through the C kernel (bf16 or float32 packed weights) a batch is bitwise its rows
        assert all(b.tokens.output_logprobs == a.tokens.output_logprobs for b, a in zip(batched, alone))


def test_requests_join_a_running_batch_and_streams_carry_their_own_text(tiny_model_dir):
    async def go():
        async with LocalEngine(tiny_model_dir, max_batch_size=4) as eng:
            long = {"messages": [{"role": "user", "content": "Hi"}], "seed": 1, "max_tokens": 60, "temperature": 1.0}
            events, texts = [], []

            async def consume(body):
                text = ""
                async for ev in eng.stream(_req(dict(body, stream=True))):
                    if ev.event is None and isinstance(ev.data, dict):
                        text += "".join(c["delta"].get("content") or "" for c in ev.data["choices"])
                    elif ev.event is not None:
                        events.append(ev.data)
                texts.append(text)

            first = asyncio.ensure_future(consume(long))
            deadline = asyncio.get_running_loop().time() + 30
            while eng.stats["decode_steps"] < 3:  # the long one is decoding
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.005)
            later = [dict(b, max_tokens=8) for b in BODIES[:5]]  # 5 > max_batch_size: one waits for a free row
            results = await asyncio.gather(*(eng.complete(_req(b)) for b in later))
            await first
            alone = [await eng.complete(_req(b)) for b in later]
            solo = await eng.complete(_req(long))
            return eng.stats, results, alone, events, texts, solo

    stats, results, alone, events, texts, solo = asyncio.run(go())
    assert 2 <= stats["max_rows"] <= 4
    assert [r.tokens.output_ids for r in results] == [a.tokens.output_ids for a in alone]
    assert events[0]["output_ids"] == solo.tokens.output_ids
    assert texts[0] == solo.body["choices"][0]["message"]["content"]


def test_a_swap_waits_for_the_batch_and_no_request_spans_two_versions(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    with torch.no_grad():
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items() if "mlp" in k}
    body = {"messages": [{"role": "user", "content": "Count"}], "temperature": 1.0, "max_tokens": 20}

    async def go():
        async with LocalEngine(tiny_model_dir, version="v0") as eng:
            gate, held = await _hold(eng)
            before = [asyncio.ensure_future(eng.complete(_req(dict(body, seed=i)))) for i in range(3)]
            await asyncio.sleep(0)
            swap = asyncio.ensure_future(eng.swap_weights("v1", new))
            await asyncio.sleep(0)
            after = [asyncio.ensure_future(eng.complete(_req(dict(body, seed=i)))) for i in range(3)]
            await asyncio.sleep(0)
            gate.set()
            await held
            return await asyncio.gather(*before), await swap, await asyncio.gather(*after), eng.stats["max_rows"]

    before, _, after, rows = asyncio.run(go())
    assert rows == 3
    assert [r.tokens.version for r in before] == ["v0"] * 3 and [r.tokens.version for r in after] == ["v1"] * 3
    for r in before:
        assert torch.allclose(torch.tensor(r.tokens.output_logprobs), _logprobs(model, r.tokens.prompt_ids,
                                                                                r.tokens.output_ids)[0], atol=1e-4)
    model.load_state_dict(new, strict=False)
    for r in after:
        assert torch.allclose(torch.tensor(r.tokens.output_logprobs), _logprobs(model, r.tokens.prompt_ids,
                                                                                r.tokens.output_ids)[0], atol=1e-4)


def test_rows_share_a_step_only_with_rows_of_the_same_adapter(tiny_model_dir):
    base, _ = load_model(tiny_model_dir)
    base.eval()
    (a, ref_a), (b, ref_b) = random_adapter(base, 1), random_adapter(base, 2)
    body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "temperature": 1.0, "max_tokens": 10}

    async def go():
        async with LocalEngine(tiny_model_dir, version="inc:0") as eng:
            await eng.load_adapter("a", "a:1", a)
            await eng.load_adapter("b", "b:1", b)
            gate, held = await _hold(eng)
            frozen = ["a:1", "a:1", "b:1", "b:1", None, "a:1"]
            tasks = [asyncio.ensure_future(eng.complete(_req(dict(body, seed=i), version=v)))
                     for i, v in enumerate(frozen)]
            await asyncio.sleep(0)
            gate.set()
            await held
            return frozen, await asyncio.gather(*tasks), eng.stats["max_rows"]

    frozen, results, rows = asyncio.run(go())
    assert rows == 2  # a pair per adapter (and the base alone): never two adapters in one step
    models = {"a:1": ref_a, "b:1": ref_b, None: base}
    for v, r in zip(frozen, results):
        assert r.tokens.version == (v or "inc:0")
        expected, _ = _logprobs(models[v], r.tokens.prompt_ids, r.tokens.output_ids)
        assert torch.allclose(torch.tensor(r.tokens.output_logprobs), expected, atol=1e-4, rtol=0)


def test_max_batch_size_one_serves_one_at_a_time_and_bad_values_are_refused(tiny_model_dir):
    async def go():
        async with LocalEngine(tiny_model_dir, max_batch_size=1) as eng:
            gate, held = await _hold(eng)
            tasks = [asyncio.ensure_future(eng.complete(_req(dict(b, max_tokens=4)))) for b in BODIES[:3]]
            await asyncio.sleep(0)
            gate.set()
            await held
            await asyncio.gather(*tasks)
            return eng.stats["max_rows"]

    assert asyncio.run(go()) == 1
    for bad in (0, -1, 1.5, True, "8", 10_000):
        with pytest.raises(ConfigError, match="max_batch_size"):
            LocalEngine(tiny_model_dir, max_batch_size=bad)


def test_bf16_kernel_on_a_batch_of_rows_is_bitwise_each_row_alone():
    fn = kernel()
    if fn is None:
        pytest.skip("no C compiler for the kernel")
    from reef_core.engines.kernels import set_threads

    set_threads(2)  # (300, 576) is split across threads: each thread's rows of every input
    torch.manual_seed(2)
    for n, k in [(300, 576), (37, 50), (5, 7)]:
        w = torch.randn(n, k).to(torch.bfloat16).float()
        mat, x, b = PackedMatrix(w, fn), torch.randn(8, k), torch.randn(n)
        batch = mat(x, b, torch.empty(8, n))
        rows = torch.cat([mat(x[i:i + 1], b, torch.empty(1, n)) for i in range(8)])
        assert torch.equal(batch, rows)
        assert torch.allclose(batch, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
