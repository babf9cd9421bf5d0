"""LocalEngine on the tiny random-init model: token data, sampling, streaming, stops and weight swaps."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from reef_core.engines.base import TOKENS_EVENT, EngineRequest
from reef_core.engines.local import LocalEngine
from reef_core.errors import ConfigError, ValidationFailed
from reef_core.models.device import resolve_device

MESSAGES = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "What is 2 + 3?"}]


def _req(**body):
    return EngineRequest("openai", "chat", {"model": "tiny", "messages": MESSAGES, **body}, {})


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    from reef_core.models.loading import load_model

    return load_model(tiny_model_dir)


def _recompute(model, prompt_ids, output_ids):
    """log_softmax of a full (cache-free) forward pass, at each sampled token."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp, lp[torch.arange(len(output_ids)), torch.tensor(output_ids)]


async def _events(engine, req):
    return [ev async for ev in engine.stream(req)]


def _engine(tiny_model_dir, **kw):
    return LocalEngine(tiny_model_dir, max_new_tokens=16, **kw)


def test_tokens_and_logprobs_match_a_recomputed_forward(tiny_model_dir, ref):
    async def go():
        async with _engine(tiny_model_dir) as eng:
            return await eng.complete(_req(seed=7, temperature=0.7, top_p=0.8, max_tokens=24))

    r = asyncio.run(go())
    model, tok = ref
    ChatCompletion.model_validate(r.body)
    t = r.tokens
    prompt_text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert t.prompt_ids == tok(prompt_text, add_special_tokens=False)["input_ids"]
    assert 0 < len(t.output_ids) == len(t.output_logprobs) == r.body["usage"]["completion_tokens"] <= 24
    assert r.body["usage"]["prompt_tokens"] == len(t.prompt_ids)
    _, expected = _recompute(model, t.prompt_ids, t.output_ids)
    # the raw temperature-1 distribution, not the temperature-0.7 / top-p-0.8 one used for sampling
    assert torch.allclose(torch.tensor(t.output_logprobs), expected, atol=1e-4, rtol=0)
    assert t.version == r.version == "base" and r.body["system_fingerprint"] == "reef-base"
    text = tok.decode([i for i in t.output_ids if i != tok.eos_token_id], skip_special_tokens=True)
    if "\ufffd" not in text:  # random byte tokens can split a character; otherwise the text is exact
        assert r.body["choices"][0]["message"]["content"] == text


def test_greedy_is_argmax_and_deterministic(tiny_model_dir, ref):
    async def go():
        async with _engine(tiny_model_dir) as eng:
            runs = [await eng.complete(_req(temperature=0, max_tokens=12)) for _ in range(2)]
            nucleus0 = await eng.complete(_req(temperature=1.0, top_p=0.0, max_tokens=12))  # only the top token
            return runs + [nucleus0]

    a, b, c = asyncio.run(go())
    assert a.tokens.output_ids == b.tokens.output_ids == c.tokens.output_ids
    lp, _ = _recompute(ref[0], a.tokens.prompt_ids, a.tokens.output_ids)
    assert a.tokens.output_ids == lp.argmax(dim=-1).tolist()


def test_stream_matches_non_stream_with_the_same_seed(tiny_model_dir):
    async def go():
        async with _engine(tiny_model_dir) as eng:
            r = await eng.complete(_req(seed=11, max_tokens=20, logprobs=True, top_logprobs=2))
            ev = await _events(eng, _req(seed=11, max_tokens=20, logprobs=True, top_logprobs=2, stream=True,
                                         stream_options={"include_usage": True}))
            return r, ev

    r, events = asyncio.run(go())
    assert events[-1].data == "[DONE]" and events[-2].event == TOKENS_EVENT
    usage_chunk, finish_chunk = events[-3].data, events[-4].data
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == r.body["usage"]
    assert finish_chunk["choices"][0]["finish_reason"] == r.body["choices"][0]["finish_reason"]
    assert events[0].data["choices"][0]["delta"]["role"] == "assistant"
    state = ChatCompletionStreamState()
    for ev in events[:-2]:
        state.handle_chunk(ChatCompletionChunk.model_validate(ev.data))
    streamed = state.current_completion_snapshot  # (get_final_completion refuses finish_reason "length")
    assert streamed.choices[0].message.content == r.body["choices"][0]["message"]["content"]
    tokens = events[-2].data
    assert tokens["output_ids"] == r.tokens.output_ids and tokens["prompt_ids"] == r.tokens.prompt_ids
    assert tokens["output_logprobs"] == r.tokens.output_logprobs and tokens["version"] == "base"
    stream_lps = [e for ev in events[:-2] if ev.data["choices"]
                  for e in (ev.data["choices"][0]["logprobs"] or {}).get("content") or []]
    assert stream_lps == r.body["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in stream_lps)


def test_stop_strings_and_token_budget(tiny_model_dir):
    async def go():
        async with _engine(tiny_model_dir) as eng:
            free = await eng.complete(_req(temperature=0, max_tokens=24))
            text = free.body["choices"][0]["message"]["content"]
            assert len(text) >= 6, text
            stop = text[len(text) // 2: len(text) // 2 + 2]
            cut = await eng.complete(_req(temperature=0, max_tokens=24, stop=[stop, "never-occurs"]))
            streamed = await _events(eng, _req(temperature=0, max_tokens=24, stop=stop, stream=True))
            short = await eng.complete(_req(temperature=0, max_tokens=3))
            return text, stop, cut, streamed, short

    text, stop, cut, streamed, short = asyncio.run(go())
    expected = text[: text.find(stop)]
    assert cut.body["choices"][0]["message"]["content"] == expected
    assert cut.body["choices"][0]["finish_reason"] == "stop"
    stream_text = "".join(ev.data["choices"][0]["delta"].get("content") or "" for ev in streamed
                          if isinstance(ev.data, dict) and ev.data.get("choices"))
    assert stream_text == expected  # the held-back prefix of the stop string never leaked
    assert short.body["choices"][0]["finish_reason"] == "length" and len(short.tokens.output_ids) == 3


def test_swap_weights_versions_requests(tiny_model_dir, ref):
    model, _ = ref
    noise = torch.Generator().manual_seed(3)
    key = "model.layers.1.mlp.down_proj.weight"
    new_w = model.state_dict()[key] + 0.5 * torch.randn(model.state_dict()[key].shape, generator=noise)
    swapped = copy.deepcopy(model)
    swapped.load_state_dict({key: new_w}, strict=False)

    async def go():
        async with _engine(tiny_model_dir) as eng:
            gen = eng.stream(_req(seed=1, max_tokens=40, stream=True))
            first = await gen.__anext__()  # the generation has started on "base"
            swap = asyncio.create_task(eng.swap_weights("v2", {key: new_w}))
            rest = [ev async for ev in gen]
            await swap
            after = await eng.complete(_req(seed=1, max_tokens=12))
            with pytest.raises(ValidationFailed):
                await eng.swap_weights("bad", {"no.such.weight": new_w})
            with pytest.raises(ValidationFailed):
                await eng.swap_weights("bad", {key: new_w[:, :3]})
            return first, rest, after, eng.version

    first, rest, after, version = asyncio.run(go())
    assert first.data["system_fingerprint"] == "reef-base"
    old = next(ev.data for ev in rest if ev.event == TOKENS_EVENT)
    assert old["version"] == "base"
    # the whole stream came from the old weights, although the swap was requested mid-stream
    _, expected_old = _recompute(model, old["prompt_ids"], old["output_ids"])
    assert torch.allclose(torch.tensor(old["output_logprobs"]), expected_old, atol=1e-4, rtol=0)
    assert after.tokens.version == after.version == "v2" and after.body["system_fingerprint"] == "reef-v2"
    _, expected_new = _recompute(swapped, after.tokens.prompt_ids, after.tokens.output_ids)
    _, under_old = _recompute(model, after.tokens.prompt_ids, after.tokens.output_ids)
    assert torch.allclose(torch.tensor(after.tokens.output_logprobs), expected_new, atol=1e-4, rtol=0)
    assert not torch.allclose(expected_new, under_old, atol=1e-3)  # the new weights really are different
    assert version == "v2"  # refused swaps changed nothing


def test_closing_a_stream_stops_generation(tiny_model_dir):
    async def go():
        async with _engine(tiny_model_dir) as eng:
            gen = eng.stream(_req(seed=2, max_tokens=800, stream=True))
            async for ev in gen:
                if ev.data["choices"][0]["delta"].get("content"):
                    break
            await gen.aclose()
            await eng.swap_weights("barrier")  # queued behind the cancelled generation
            return dict(eng.stats)

    stats = asyncio.run(go())
    assert stats["cancelled"] == 1 and stats["output_tokens"] < 800


def test_event_loop_stays_responsive(tiny_model_dir):
    async def go():
        async with _engine(tiny_model_dir) as eng:
            gaps, stop = [], asyncio.Event()

            async def ticker():
                last = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(0.005)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            task = asyncio.create_task(ticker())
            began = time.monotonic()
            done = await asyncio.gather(*(eng.complete(_req(seed=s, max_tokens=200)) for s in range(3, 9)))
            took = time.monotonic() - began
            stop.set()
            await task
            return gaps, took, sum(len(r.tokens.output_ids) for r in done)

    gaps, took, tokens = asyncio.run(go())
    assert tokens > 100  # the engine worked for a while ...
    assert len(gaps) >= took / 0.1 and max(gaps) < 0.5  # ... and the loop ticked all along: no generation on it


def test_count_tokens_and_refusals(tiny_model_dir):
    async def go():
        async with _engine(tiny_model_dir) as eng:
            counted = await eng.count_tokens(EngineRequest("anthropic", "count_tokens", {
                "model": "tiny", "system": "be nice", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}, {}))
            one = await eng.complete(_req(max_tokens=1))
            errors = []
            for req in (_req(n=2), _req(temperature=-1), EngineRequest("anthropic", "messages", {}, {}),
                        _req(messages=[{"role": "user", "content": "word " * 3000}])):
                try:
                    await eng.complete(req)
                except ValidationFailed as exc:
                    errors.append(exc)
            with pytest.raises(ValidationFailed):  # refused before the stream yields anything
                async for _ev in eng.stream(_req(messages=[{"role": "user", "content": "word " * 3000}], stream=True)):
                    raise AssertionError("no event expected")
            return counted, one, errors, eng.model_ids()

    counted, one, errors, ids = asyncio.run(go())
    assert counted.body == {"input_tokens": len(one.tokens.prompt_ids)}
    assert len(errors) == 4 and ids == [tiny_model_dir.name]


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(tiny_model_dir):
    huge = [{"role": "user", "content": "word " * 200_000}]  # ~1 MB of text; the tiny model's context is 1024

    async def go(eng, req, call):
        with pytest.raises(ValidationFailed, match="messages"):
            await call(req)

    async def run():
        async with _engine(tiny_model_dir) as eng:
            tokenized = []
            real = eng._prompt_ids
            eng._prompt_ids = lambda *a: tokenized.append(1) or real(*a)
            req = EngineRequest("openai", "chat", {"model": "tiny", "messages": huge}, {})
            await go(eng, req, eng.complete)
            await go(eng, req, lambda r: _events(eng, r))
            await go(eng, EngineRequest("anthropic", "count_tokens", {"model": "tiny", "messages": huge}, {}),
                     eng.count_tokens)
            assert tokenized == []  # no model work, not even the tokenizer
            # Just over the context, the exact check after tokenizing still refuses it.
            near = EngineRequest("openai", "chat", {"model": "tiny", "messages": [
                {"role": "user", "content": "word " * 1100}]}, {})
            await go(eng, near, eng.complete)
            assert tokenized

    asyncio.run(run())


@pytest.mark.parametrize("spec", ["cpu", "auto"])
def test_the_model_and_generation_live_on_the_resolved_device(tiny_model_dir, spec):
    async def go():
        async with _engine(tiny_model_dir, device=spec) as eng:
            r = await eng.complete(_req(seed=3, max_tokens=4))
            return eng.device, {p.device for p in eng._model.parameters()}, eng._gen.device, r

    device, placed, gen_device, r = asyncio.run(go())
    assert device == torch.device(resolve_device(spec)) and placed == {device} and gen_device == device
    assert r.tokens.output_ids and len(r.tokens.output_logprobs) == len(r.tokens.output_ids)


def test_a_missing_or_malformed_device_is_refused_before_loading(tiny_model_dir, tmp_path):
    from reef_core.builtins.engines import make_local_engine
    from reef_core.config.schema import EngineConfig

    for spec in ("cuda:99", "gpu"):
        with pytest.raises(ConfigError, match=r"^engine\.device"):
            _engine(tiny_model_dir, device=spec)
        # the factory checks the device before it fetches or converts the model
        with pytest.raises(ConfigError, match=r"^engine\.device"):
            make_local_engine(EngineConfig(model=str(tmp_path / "no-such-model"), device=spec), tmp_path)
    built = make_local_engine(EngineConfig(model=str(tiny_model_dir), device="cpu"), tmp_path)
    assert built.device == torch.device("cpu")
    assert make_local_engine(EngineConfig(model=str(tiny_model_dir)), tmp_path).device == torch.device(
        resolve_device(EngineConfig.device))


def test_sampling_defaults_come_from_config_then_model_then_one(tiny_model_dir, tmp_path):
    import json
    import shutil

    from reef_core.builtins.engines import make_local_engine, sampling_defaults
    from reef_core.config.schema import EngineConfig

    assert sampling_defaults(EngineConfig(), tiny_model_dir) == {"temperature": 1.0, "top_p": 1.0}
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.3, "top_p": 0.8}))
    engine = make_local_engine(EngineConfig(model=str(model), device="cpu"), tmp_path)
    assert (engine.temperature, engine.top_p) == (0.3, 0.8)
    engine = make_local_engine(EngineConfig(model=str(model), device="cpu", temperature=1.0), tmp_path)
    assert (engine.temperature, engine.top_p) == (1.0, 0.8)  # engine.* wins over the model, key by key
    with pytest.raises(ConfigError, match=r"^engine\.top_p"):
        sampling_defaults(EngineConfig(top_p=3.0), model)

    # a model that asks for greedy decoding answers deterministically when the request sets no temperature,
    # and a request's own temperature still wins
    (model / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": False}))
    engine = make_local_engine(EngineConfig(model=str(model), device="cpu", max_new_tokens=12), tmp_path)

    async def go():
        async with engine:
            plain = [await engine.complete(_req()) for _ in range(3)]
            sampled = [await engine.complete(_req(temperature=1.0, seed=s)) for s in range(3)]
            return plain, sampled

    plain, sampled = asyncio.run(go())
    assert len({tuple(r.tokens.output_ids) for r in plain}) == 1
    assert len({tuple(r.tokens.output_ids) for r in sampled}) > 1


def test_engine_num_threads_reaches_the_engine_and_bad_values_are_refused(tiny_model_dir, tmp_path):
    from reef_core.builtins.engines import make_local_engine
    from reef_core.config.schema import EngineConfig

    assert make_local_engine(EngineConfig(model=str(tiny_model_dir), num_threads=1), tmp_path).num_threads == 1
    assert make_local_engine(EngineConfig(model=str(tiny_model_dir)), tmp_path).num_threads is None
    for bad in (0, -2, 1.5, True, "2", 10_000):
        with pytest.raises(ConfigError, match=r"^engine\.num_threads"):
            make_local_engine(EngineConfig(model=str(tiny_model_dir), num_threads=bad), tmp_path)


def test_sampler_draws_from_the_softmax_and_its_top_p_nucleus():
    """The engine's sampler (one uniform per token against the cumulative mass, the nucleus from a widening topk):
    frequencies follow softmax(logits / T), top-p keeps the smallest prefix reaching p, renormalised; greedy at
    T = 0; a seed repeats its draws."""
    from reef_core.engines.local import _sample

    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    gen = torch.Generator().manual_seed(0)
    n = 20_000

    def freqs(t: float, p: float) -> torch.Tensor:
        counts = torch.zeros(5)
        for _ in range(n):
            counts[_sample(logits, t, p, gen)] += 1
        return counts / n

    probs = torch.softmax(logits, -1)  # 0.076, 0.207, 0.563, 0.028, 0.126
    assert (freqs(1.0, 1.0) - probs).abs().max() < 0.015
    hot = torch.softmax(logits / 2.0, -1)
    assert (freqs(2.0, 1.0) - hot).abs().max() < 0.015
    nucleus = torch.tensor([0.0, probs[1], probs[2], 0.0, probs[4]])  # 0.563, +0.207 = 0.770 < 0.8, +0.126
    assert (freqs(1.0, 0.8) - nucleus / nucleus.sum()).abs().max() < 0.015
    assert {_sample(logits, 1.0, 0.0, gen) for _ in range(200)} == {2}  # top_p 0: the most likely token only
    assert _sample(logits, 0.0, 1.0, gen) == 2
    wide = torch.randn(49_152) * 0.1  # a flat nucleus: the topk widens past its first 64
    assert len({_sample(wide, 1.0, 0.9, gen) for _ in range(300)}) > 250
    seq = [[_sample(logits, 1.0, 0.95, g) for _ in range(30)] for g in (torch.Generator().manual_seed(7),
                                                                         torch.Generator().manual_seed(7))]
    assert seq[0] == seq[1] and len(set(seq[0])) > 1


def test_the_samplers_pieces_compute_what_one_call_computes():
    """The sampler's elementwise ops over a vocabulary run in pieces below ATen's grain (on the calling thread):
    bitwise what one call gives, and a vocabulary-sized draw is the same token with or without the pieces."""
    from reef_core.engines import local

    torch.manual_seed(3)
    logits = torch.randn(49_152) * 3
    for op in (lambda t: t.float() / 0.7, lambda t: t.double()):
        for x in (logits, logits[:100]):
            assert torch.equal(local._serial(op, x), op(x))
    probs = torch.softmax(logits, -1)
    whole = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    assert torch.equal(torch.cumsum(local._serial(lambda t: t.double(), probs), dim=-1), whole)
    u = torch.rand((), generator=torch.Generator().manual_seed(9), dtype=torch.float64) * whole[-1]
    assert local._draw(probs, torch.Generator().manual_seed(9)) == int(torch.searchsorted(whole, u, right=True))


def test_preload_loads_once_and_start_waits_for_that_load(tiny_model_dir, monkeypatch):
    import reef_core.engines.local as local

    loads = []
    real = local._load_model

    def counted(model_dir):
        loads.append(model_dir)
        time.sleep(0.2)  # still loading when start() is called: start must wait for this load, not begin another
        return real(model_dir)

    monkeypatch.setattr(local, "_load_model", counted)

    async def go():
        eng = _engine(tiny_model_dir)
        eng.preload()
        eng.preload()  # a second call queues nothing more
        await eng.start()
        assert eng._model is not None  # loaded when start returns
        await eng.start()  # idempotent
        r = await eng.complete(_req(seed=1, max_tokens=3))
        await eng.close()
        return r

    r = asyncio.run(go())
    assert len(loads) == 1 and r.tokens.output_ids


def test_a_preloaded_engine_closes_without_starting_and_a_failed_preload_raises_at_start(tiny_model_dir,
                                                                                        monkeypatch):
    import reef_core.engines.local as local

    async def closed_unstarted():
        eng = _engine(tiny_model_dir)
        eng.preload()
        await eng.close()  # waits for the load, then ends the worker
        return eng

    eng = asyncio.run(closed_unstarted())
    assert eng._worker is None and eng._model is None

    def broken(model_dir):
        raise OSError("weights unreadable")

    monkeypatch.setattr(local, "_load_model", broken)

    async def failed():
        eng = _engine(tiny_model_dir)
        eng.preload()
        with pytest.raises(OSError, match="weights unreadable"):
            await eng.start()
        return eng

    assert asyncio.run(failed())._worker is None
