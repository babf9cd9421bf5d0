"""SGLangEngine against FakeSGLang (a real tiny model behind SGLang's HTTP routes): token capture equal to a
recomputed forward, streaming, passthrough, retries, versioned full-weight publishes and per-version LoRA adapters."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from reef_core.engines.base import TOKENS_EVENT, EngineRequest
from reef_core.engines.remote import RemoteOptions
from reef_core.engines.sglang import SGLangEngine, adapter_name
from reef_core.errors import ConfigError, UpstreamError, UpstreamTimeout, ValidationFailed
from reef_core.testing import serve_asgi
from reef_core.testing.fake_sglang import FakeSGLang
from reef_core.testing.remote_checks import perturbed as _perturbed
from reef_core.testing.remote_checks import random_adapter as _adapter
from reef_core.testing.remote_checks import reference_logprobs as _reference_logprobs
from reef_core.testing.remote_checks import with_adapter as _merged

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _req(version=None, tokens=True, **body):
    return EngineRequest("openai", "chat", {"model": "tiny", "messages": MESSAGES, **body}, {}, version=version,
                         tokens=tokens)


@pytest.fixture(scope="module")
def fake_app(tiny_model_dir):
    return FakeSGLang(tiny_model_dir)


@pytest.fixture(scope="module")
def fake_url(fake_app):
    with serve_asgi(fake_app) as url:
        yield url


@pytest.fixture
def fake(fake_app, fake_url, tiny_model_dir):
    """(app, url), the fake back on its base weights with no adapters, faults or delay."""
    from reef_core.models.loading import load_model

    fake_app.model.load_state_dict(load_model(tiny_model_dir)[0].state_dict())
    fake_app._adapters.clear()
    fake_app._known.clear()
    fake_app._faults.clear()
    fake_app.token_delay_s = 0.0
    fake_app.weight_version = "default"
    return fake_app, fake_url


def _engine(url, model_dir, tmp_path, **kw):
    return SGLangEngine(url, model_dir, version=kw.pop("version", "inc:0"), weights_dir=tmp_path / "weights",
                        options=RemoteOptions(ready_timeout_s=10, **kw))


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from reef_core.models.loading import load_model

    return load_model(tiny_model_dir)[0]


def test_recorded_logprobs_and_top_k_equal_a_recomputed_forward(fake, tiny_model_dir, tmp_path, base):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path, top_k_logprobs=5) as engine:
            resp = await engine.complete(_req(temperature=0.8, max_tokens=12, seed=7))
            return resp, engine._prompt_ids(MESSAGES, None)

    resp, prompt_ids = asyncio.run(main())
    tokens = resp.tokens
    assert resp.status == 200 and tokens.prompt_ids == prompt_ids and tokens.version == "inc:0"
    sent = [e["body"] for e in app.log if e["route"] == "generate"][-1]
    assert sent["input_ids"] == prompt_ids and sent["return_logprob"] is True and sent["top_logprobs_num"] == 5
    assert sent["sampling_params"]["temperature"] == 0.8 and sent["sampling_params"]["max_new_tokens"] == 12
    chosen, full = _reference_logprobs(base, tokens.prompt_ids, tokens.output_ids)
    assert torch.allclose(torch.tensor(tokens.output_logprobs), chosen, atol=1e-4)
    for t in range(len(tokens.output_ids)):
        ids, lps = tokens.top_k.row(t)
        ref_vals, ref_ids = torch.topk(full[t], 5)
        assert ids == ref_ids.tolist()
        assert torch.allclose(torch.tensor(lps), ref_vals, atol=1e-4)
    assert resp.body["choices"][0]["message"]["content"] == app.tok.decode(
        [i for i in tokens.output_ids if i not in app.eos], skip_special_tokens=True)
    assert resp.body["usage"]["completion_tokens"] == len(tokens.output_ids)


def test_stream_relays_text_then_token_data_before_done(fake, tiny_model_dir, tmp_path, base):
    _app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            plain = await engine.complete(_req(temperature=0, max_tokens=10))
            events = [ev async for ev in engine.stream(_req(temperature=0, max_tokens=10, stream=True,
                                                            stream_options={"include_usage": True}))]
            return plain, events

    plain, events = asyncio.run(main())
    assert events[-1].data == "[DONE]" and events[-2].event == TOKENS_EVENT
    text = "".join(ev.data["choices"][0]["delta"].get("content", "") for ev in events
                   if isinstance(ev.data, dict) and ev.data.get("choices"))
    assert text == plain.body["choices"][0]["message"]["content"]
    tokens = events[-2].data
    assert tokens["output_ids"] == plain.tokens.output_ids and tokens["version"] == "inc:0"
    chosen, _ = _reference_logprobs(base, tokens["prompt_ids"], tokens["output_ids"])
    assert torch.allclose(torch.tensor(tokens["output_logprobs"]), chosen, atol=1e-4)
    assert any(isinstance(ev.data, dict) and ev.data.get("usage") for ev in events)


def test_scenarios_without_training_pass_through_the_openai_route(fake, tiny_model_dir, tmp_path):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            before = dict(app.stats)
            resp = await engine.complete(_req(tokens=False, max_tokens=4))
            events = [ev async for ev in engine.stream(_req(tokens=False, max_tokens=4, stream=True))]
            return before, resp, events

    before, resp, events = asyncio.run(main())
    assert resp.tokens is None and resp.body["object"] == "chat.completion"
    assert events[-1].data == "[DONE]"
    assert app.stats["chat"] == before["chat"] + 2 and app.stats["generate"] == before["generate"]


def test_a_server_returning_temperature_scaled_logprobs_is_refused(tiny_model_dir, tmp_path):
    app = FakeSGLang(tiny_model_dir, original_logprob=False)
    with serve_asgi(app) as url:
        with pytest.raises(ConfigError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
            asyncio.run(_engine(url, tiny_model_dir, tmp_path).start())


def test_readiness_deadline_names_the_key(tiny_model_dir, tmp_path):
    from reef_core.testing.fixtures import free_port

    engine = SGLangEngine(f"http://127.0.0.1:{free_port()}", tiny_model_dir, version="inc:0",
                          weights_dir=tmp_path, options=RemoteOptions(ready_timeout_s=0.5))
    with pytest.raises(UpstreamError, match="engine.ready_timeout_s"):
        asyncio.run(engine.start())


@pytest.mark.parametrize("body, param", [({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"),
                                         ({"temperature": 3}, "temperature"), ({"stop": 3}, "stop")])
def test_training_requests_are_validated(fake, tiny_model_dir, tmp_path, body, param):
    _app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            await engine.complete(_req(**body))

    with pytest.raises(ValidationFailed) as err:
        asyncio.run(main())
    assert err.value.param == param


def test_engine_aborted_requests_are_retried_until_the_deadline(fake, tiny_model_dir, tmp_path):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path, retry_timeout_s=5) as engine:
            app.add_fault("generate", 2, abort=True)
            resp = await engine.complete(_req(max_tokens=3))
            retries = engine.stats["retries"]
            app.add_fault("generate", 1000, abort=True)
            engine.retry_timeout_s = 0.3
            with pytest.raises(UpstreamTimeout, match="retry_timeout_s"):
                await engine.complete(_req(max_tokens=3))
            return resp, retries

    resp, retries = asyncio.run(main())
    assert resp.status == 200 and retries == 2


def test_in_flight_request_finishes_on_the_old_version_while_a_publish_happens(fake, tiny_model_dir, tmp_path,
                                                                              base):
    app, url = fake
    new_state = _perturbed(base, 1)

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            app.token_delay_s = 0.05
            slow = asyncio.create_task(engine.complete(_req(max_tokens=12, temperature=1.0, seed=3)))
            deadline = time.monotonic() + 10
            while not app.in_flight:
                assert time.monotonic() < deadline, "the request never reached the server"
                await asyncio.sleep(0.01)
            await engine.swap_weights("inc:1", new_state)
            assert slow.done(), "the publish must wait for the in-flight request"
            app.token_delay_s = 0.0
            after = await engine.complete(_req(max_tokens=6, temperature=1.0, seed=3))
            return await slow, after, engine.version

    old, new, version = asyncio.run(main())
    assert old.tokens.version == "inc:0" and new.tokens.version == "inc:1" and version == "inc:1"
    assert app.weight_version == "inc:1" and app.paused is None
    chosen, _ = _reference_logprobs(base, old.tokens.prompt_ids, old.tokens.output_ids)
    assert torch.allclose(torch.tensor(old.tokens.output_logprobs), chosen, atol=1e-4)
    updated = copy.deepcopy(base)
    updated.load_state_dict(new_state)
    chosen, _ = _reference_logprobs(updated, new.tokens.prompt_ids, new.tokens.output_ids)
    assert torch.allclose(torch.tensor(new.tokens.output_logprobs), chosen, atol=1e-4)


def test_a_failed_disk_update_leaves_the_old_release_serving(fake, tiny_model_dir, tmp_path, base):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            app.add_fault("update_weights_from_disk")
            with pytest.raises(UpstreamError, match="injected failure"):
                await engine.swap_weights("inc:1", _perturbed(base, 2))
            resp = await engine.complete(_req(max_tokens=4, seed=1))
            return engine.version, resp

    version, resp = asyncio.run(main())
    assert version == "inc:0" and app.weight_version == "inc:0" and app.paused is None
    assert resp.tokens.version == "inc:0"
    chosen, _ = _reference_logprobs(base, resp.tokens.prompt_ids, resp.tokens.output_ids)
    assert torch.allclose(torch.tensor(resp.tokens.output_logprobs), chosen, atol=1e-4)


def test_two_lora_scenarios_get_their_own_versioned_adapters_and_old_ones_unload(fake, tiny_model_dir, tmp_path,
                                                                               base):
    app, url = fake
    a1, a2, b1 = _adapter(base, 1), _adapter(base, 2), _adapter(base, 3)
    va1, va2, vb1 = "inc.aaaaaaaa:1", "inc.aaaaaaaa:2", "inc.bbbbbbbb:1"

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            await engine.load_adapter("A", va1, a1)
            await engine.load_adapter("B", vb1, b1)
            ra = await engine.complete(_req(version=va1, max_tokens=6, seed=1))
            rb = await engine.complete(_req(version=vb1, max_tokens=6, seed=1))
            names = engine.adapter_names()
            loaded_before = app.loaded_adapters()
            await engine.load_adapter("A", va2, a2)
            ra_frozen_old = await engine.complete(_req(version=va1, max_tokens=6, seed=1))  # frozen before the move
            await engine.settled()
            return ra, rb, names, loaded_before, ra_frozen_old, app.loaded_adapters()

    ra, rb, names, loaded_before, ra2, loaded_after = asyncio.run(main())
    assert names == {"A": "aaaaaaaa-v1", "B": "bbbbbbbb-v1"} == {"A": adapter_name(va1), "B": adapter_name(vb1)}
    assert set(loaded_before) == {"aaaaaaaa-v1", "bbbbbbbb-v1"}
    assert set(loaded_after) == {"aaaaaaaa-v2", "bbbbbbbb-v1"}
    assert ra.tokens.version == va1 and rb.tokens.version == vb1 and ra2.tokens.version == va2
    for resp, adapter in ((ra, a1), (rb, b1), (ra2, a2)):
        chosen, _ = _reference_logprobs(_merged(base, adapter), resp.tokens.prompt_ids, resp.tokens.output_ids)
        assert torch.allclose(torch.tensor(resp.tokens.output_logprobs), chosen, atol=1e-4)
    sent = [e["body"].get("lora_path") for e in app.log if e["route"] == "generate"][-3:]
    assert sent == ["aaaaaaaa-v1", "bbbbbbbb-v1", "aaaaaaaa-v2"]


def test_residency_bound_unloads_idle_adapters_and_reloads_on_use(fake, tiny_model_dir, tmp_path, base):
    app, url = fake
    a, b = _adapter(base, 4), _adapter(base, 5)

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path, max_loaded_loras=1) as engine:
            await engine.load_adapter("A", "inc.aaaaaaaa:1", a)
            await engine.load_adapter("B", "inc.bbbbbbbb:1", b)
            only_b = app.loaded_adapters()
            resp = await engine.complete(_req(version="inc.aaaaaaaa:1", max_tokens=5, seed=2))
            return only_b, resp, app.loaded_adapters()

    only_b, resp, only_a = asyncio.run(main())
    assert only_b == ["bbbbbbbb-v1"] and only_a == ["aaaaaaaa-v1"]
    chosen, _ = _reference_logprobs(_merged(base, a), resp.tokens.prompt_ids, resp.tokens.output_ids)
    assert torch.allclose(torch.tensor(resp.tokens.output_logprobs), chosen, atol=1e-4)


def test_a_restarted_engine_clears_what_an_earlier_process_left(fake, tiny_model_dir, tmp_path, base):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path / "one") as first:
            await first.swap_weights("old:1", _perturbed(base, 6))
        async with _engine(url, tiny_model_dir, tmp_path / "two", version="new:0") as first_lora:
            pass
        async with _engine(url, tiny_model_dir, tmp_path / "three", version="lora:0") as lora:
            await lora.load_adapter("A", "lora.aaaaaaaa:1", _adapter(base, 7))
        left = app.loaded_adapters()
        async with _engine(url, tiny_model_dir, tmp_path / "four", version="again:0") as second:
            resp = await second.complete(_req(max_tokens=5, seed=4))
        return left, resp

    left, resp = asyncio.run(main())
    assert left == ["aaaaaaaa-v1"] and app.loaded_adapters() == []
    assert resp.tokens.version == "again:0"
    chosen, _ = _reference_logprobs(base, resp.tokens.prompt_ids, resp.tokens.output_ids)
    assert torch.allclose(torch.tensor(resp.tokens.output_logprobs), chosen, atol=1e-4)
