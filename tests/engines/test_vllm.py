"""VLLMEngine against FakeVLLM (a real tiny model behind vLLM's OpenAI routes): token capture equal to a recomputed
forward, streaming, passthrough, retries, versioned full-weight publishes and per-version LoRA adapters."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from reef_core.engines.base import TOKENS_EVENT, EngineRequest
from reef_core.engines.remote import RemoteOptions
from reef_core.engines.untie import untied_copy
from reef_core.engines.vllm import VLLMEngine, adapter_name
from reef_core.errors import ConfigError, UpstreamError, UpstreamTimeout, ValidationFailed
from reef_core.testing import serve_asgi
from reef_core.testing.fake_vllm import FakeVLLM
from reef_core.testing.remote_checks import perturbed, random_adapter, reference_logprobs, with_adapter

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _req(version=None, tokens=True, **body):
    return EngineRequest("openai", "chat", {"model": "tiny", "messages": MESSAGES, **body}, {}, version=version,
                         tokens=tokens)


@pytest.fixture(scope="module")
def served_dir(tiny_model_dir, tmp_path_factory):
    """What vLLM serves of the tiny model (it ties its embeddings): Reef's untied copy, as engine.launch serves."""
    return untied_copy(tiny_model_dir, tmp_path_factory.mktemp("served") / "tiny-untied")


@pytest.fixture(scope="module")
def fake_app(served_dir):
    return FakeVLLM(served_dir)


@pytest.fixture(scope="module")
def fake_url(fake_app):
    with serve_asgi(fake_app) as url:
        yield url


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from reef_core.models.loading import load_model

    return load_model(tiny_model_dir)[0]


@pytest.fixture
def fake(fake_app, fake_url, base, served_dir):
    """(app, url), the fake back on its base weights with no adapters, faults or delay."""
    fake_app.revive()
    fake_app._adapters.clear()
    fake_app._known.clear()
    fake_app._faults.clear()
    fake_app.token_delay_s = 0.0
    fake_app.weight_version = "default"
    fake_app.crashed = None
    return fake_app, fake_url


def _engine(url, model_dir, tmp_path, **kw):
    return VLLMEngine(url, model_dir, version=kw.pop("version", "inc:0"), weights_dir=tmp_path / "weights",
                      options=RemoteOptions(ready_timeout_s=10, **kw))


def _close(tokens, model) -> bool:
    chosen, _ = reference_logprobs(model, tokens.prompt_ids, tokens.output_ids)
    return torch.allclose(torch.tensor(tokens.output_logprobs), chosen, atol=1e-4)


def _completions(app) -> list[dict]:
    return [e["body"] for e in app.log if e["route"] == "completions"]


def test_recorded_logprobs_and_top_k_equal_a_recomputed_forward(fake, tiny_model_dir, tmp_path, base):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path, top_k_logprobs=5) as engine:
            resp = await engine.complete(_req(temperature=0.8, max_tokens=12, seed=7))
            return resp, engine._prompt_ids(MESSAGES, None)

    resp, prompt_ids = asyncio.run(main())
    tokens = resp.tokens
    assert resp.status == 200 and tokens.prompt_ids == prompt_ids and tokens.version == "inc:0"
    sent = _completions(app)[-1]
    assert sent["prompt"] == prompt_ids and sent["logprobs"] == 5 and sent["return_tokens_as_token_ids"] is True
    assert sent["temperature"] == 0.8 and sent["max_tokens"] == 12 and sent["model"] == app.served_model_name
    assert sent["top_k"] == -1 and sent["min_p"] == 0.0 and sent["repetition_penalty"] == 1.0
    chosen, full = reference_logprobs(base, tokens.prompt_ids, tokens.output_ids)
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
            events = [ev async for ev in engine.stream(_req(temperature=0, max_tokens=10, stream=True, logprobs=True,
                                                            stream_options={"include_usage": True}))]
            return plain, events

    plain, events = asyncio.run(main())
    assert events[-1].data == "[DONE]" and events[-2].event == TOKENS_EVENT
    chunks = [ev.data for ev in events if isinstance(ev.data, dict) and ev.data.get("choices")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain.body["choices"][0]["message"]["content"]
    relayed = [e["logprob"] for c in chunks if c["choices"][0].get("logprobs")
               for e in c["choices"][0]["logprobs"]["content"]]
    tokens = events[-2].data
    assert tokens["output_ids"] == plain.tokens.output_ids and tokens["version"] == "inc:0"
    assert relayed == tokens["output_logprobs"][:len(relayed)] and relayed
    chosen, _ = reference_logprobs(base, tokens["prompt_ids"], tokens["output_ids"])
    assert torch.allclose(torch.tensor(tokens["output_logprobs"]), chosen, atol=1e-4)
    assert any(isinstance(ev.data, dict) and ev.data.get("usage") for ev in events)


def test_scenarios_without_training_pass_through_under_the_served_name(fake, tiny_model_dir, tmp_path):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            before = dict(app.stats)
            resp = await engine.complete(_req(tokens=False, max_tokens=4))
            events = [ev async for ev in engine.stream(_req(tokens=False, max_tokens=4, stream=True))]
            return before, resp, events

    before, resp, events = asyncio.run(main())
    assert resp.status == 200 and resp.tokens is None and resp.body["object"] == "chat.completion"
    assert events[-1].data == "[DONE]"
    assert app.stats["chat"] == before["chat"] + 2 and app.stats["completions"] == before["completions"]
    assert [e["body"]["model"] for e in app.log if e["route"] == "chat"][-2:] == [app.served_model_name] * 2


def test_a_server_returning_processed_logprobs_is_refused(tiny_model_dir, tmp_path):
    with serve_asgi(FakeVLLM(tiny_model_dir, logprobs_mode="processed_logprobs")) as url:
        with pytest.raises(ConfigError, match="--logprobs-mode raw_logprobs"):
            asyncio.run(_engine(url, tiny_model_dir, tmp_path).start())


def test_a_server_capping_logprobs_below_top_k_is_refused_naming_the_flag(fake, tiny_model_dir, tmp_path):
    _app, url = fake
    with pytest.raises(ConfigError, match="--max-logprobs 30"):
        asyncio.run(_engine(url, tiny_model_dir, tmp_path, top_k_logprobs=30).start())


def test_a_server_without_dev_mode_is_refused_naming_the_variable(tiny_model_dir, tmp_path):
    with serve_asgi(FakeVLLM(tiny_model_dir, dev_mode=False)) as url:
        with pytest.raises(ConfigError, match="VLLM_SERVER_DEV_MODE=1"):
            asyncio.run(_engine(url, tiny_model_dir, tmp_path).start())


@pytest.mark.parametrize("body, param", [({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"),
                                         ({"temperature": 3}, "temperature")])
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
    new_state = perturbed(base, 1)

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
    assert app.weight_version == "inc:1" and app.paused is None and app.stats["reloads"] >= 1
    assert _close(old.tokens, base)
    updated = copy.deepcopy(base)
    updated.load_state_dict(new_state)
    assert _close(new.tokens, updated)


@pytest.mark.parametrize("after_load", [False, True], ids=["before-loading", "after-loading"])
def test_a_failed_reload_leaves_the_old_release_serving(fake, tiny_model_dir, tmp_path, base, after_load):
    """A failed worker call leaves vLLM 0.32's engine failing at its next step unless a reload succeeds first: Reef
    reloads the release that served before while generation is paused, so the server stays up and serves it."""
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            await engine.swap_weights("inc:1", perturbed(base, 2))
            serving = {k: v.clone() for k, v in app.model.state_dict().items()}
            app.add_fault("reload_weights", after_load=after_load)
            with pytest.raises(UpstreamError, match="injected failure"):
                await engine.swap_weights("inc:2", perturbed(base, 3))
            resp = await engine.complete(_req(max_tokens=4, seed=1))
            return engine.version, resp, serving

    version, resp, serving = asyncio.run(main())
    assert version == "inc:1" and app.weight_version == "inc:1" and app.paused is None and app.crashed is None
    assert all(torch.equal(v, serving[k]) for k, v in app.model.state_dict().items())
    assert resp.tokens.version == "inc:1" and _close(resp.tokens, app.model)
    assert app.load_path.name == "inc_1"  # the loader points at the release that serves


def test_a_reload_that_stops_the_server_is_undone_once_it_answers_again(fake, tiny_model_dir, tmp_path, base):
    """A server that goes down during a reload: requests fail while it is down (none is stamped with a version it
    does not serve), and once its supervisor restarts it (on the base weights) Reef loads the release that served
    before and its label, before the first request."""
    app, url = fake
    good = perturbed(base, 2)

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            await engine.swap_weights("inc:1", good)
            app.add_fault("reload_weights", crash=True)
            with pytest.raises(UpstreamError, match="injected failure"):
                await engine.swap_weights("inc:2", perturbed(base, 3))
            down = app.crashed
            with pytest.raises(UpstreamError, match="has not answered since a failed weight update"):
                await engine.complete(_req(max_tokens=4, seed=1))
            app.revive()
            resp = await engine.complete(_req(max_tokens=4, seed=1))
            return engine.version, down, resp

    version, down, resp = asyncio.run(main())
    assert down is not None and version == "inc:1" and app.weight_version == "inc:1"
    served = copy.deepcopy(base)
    served.load_state_dict(good)
    assert resp.tokens.version == "inc:1" and _close(resp.tokens, served)
    assert all(torch.equal(v, served.state_dict()[k]) for k, v in app.model.state_dict().items())


def test_a_release_the_server_could_not_load_is_refused_before_the_server_sees_it(fake, tiny_model_dir, tmp_path,
                                                                                   base):
    app, url = fake
    bad = perturbed(base, 4)
    key = next(k for k, v in bad.items() if v.dim() == 2)
    bad[key] = torch.zeros(3, 3)

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            reloads = app.stats["reloads"]
            with pytest.raises(UpstreamError, match=f"tensor {key} has shape"):
                await engine.swap_weights("inc:1", bad)
            resp = await engine.complete(_req(max_tokens=4, seed=1))
            return engine.version, reloads, resp

    version, reloads, resp = asyncio.run(main())
    assert version == "inc:0" and app.stats["reloads"] == reloads and app.crashed is None
    assert resp.tokens.version == "inc:0" and _close(resp.tokens, base)
    assert not list((tmp_path / "weights" / "full").glob("*"))  # nothing half-written left behind


def test_paths_sent_to_the_server_are_absolute_whatever_its_working_directory(fake, tiny_model_dir, tmp_path, base,
                                                                             monkeypatch):
    app, url = fake
    app.cwd = tmp_path / "elsewhere"  # the server runs in another directory
    monkeypatch.chdir(tmp_path)

    async def main():
        engine = VLLMEngine(url, tiny_model_dir, version="inc:0", weights_dir="relative-weights",
                            options=RemoteOptions(ready_timeout_s=10))
        async with engine:
            await engine.load_adapter("A", "inc.aaaaaaaa:1", random_adapter(base, 1))
            await engine.swap_weights("inc:2", None)
            return engine.weights_dir

    weights_dir = asyncio.run(main())
    assert weights_dir == tmp_path / "relative-weights"
    assert app._known["aaaaaaaa-v1"] == tmp_path / "relative-weights" / "adapters" / "aaaaaaaa-v1"


def test_two_lora_scenarios_get_their_own_versioned_adapters_and_old_ones_unload(fake, tiny_model_dir, tmp_path,
                                                                               base):
    app, url = fake
    a1, a2, b1 = random_adapter(base, 1), random_adapter(base, 2), random_adapter(base, 3)
    va1, va2, vb1 = "inc.aaaaaaaa:1", "inc.aaaaaaaa:2", "inc.bbbbbbbb:1"

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            await engine.load_adapter("A", va1, a1)
            await engine.load_adapter("B", vb1, b1)
            ra = await engine.complete(_req(version=va1, max_tokens=6, seed=1))
            rb = await engine.complete(_req(version=vb1, max_tokens=6, seed=1))
            names = engine.adapter_names()
            loaded_before = sorted(app._known)
            await engine.load_adapter("A", va2, a2)
            ra2 = await engine.complete(_req(version=va1, max_tokens=6, seed=1))  # frozen before the move
            await engine.settled()
            return ra, rb, names, loaded_before, ra2, sorted(app._known)

    ra, rb, names, loaded_before, ra2, loaded_after = asyncio.run(main())
    assert names == {"A": "aaaaaaaa-v1", "B": "bbbbbbbb-v1"} == {"A": adapter_name(va1), "B": adapter_name(vb1)}
    assert loaded_before == ["aaaaaaaa-v1", "bbbbbbbb-v1"] and loaded_after == ["aaaaaaaa-v2", "bbbbbbbb-v1"]
    assert ra.tokens.version == va1 and rb.tokens.version == vb1 and ra2.tokens.version == va2
    for resp, adapter in ((ra, a1), (rb, b1), (ra2, a2)):
        assert _close(resp.tokens, with_adapter(base, adapter))
    assert [b["model"] for b in _completions(app)[-3:]] == ["aaaaaaaa-v1", "bbbbbbbb-v1", "aaaaaaaa-v2"]


def test_residency_bound_unloads_idle_adapters_and_reloads_on_use(fake, tiny_model_dir, tmp_path, base):
    app, url = fake
    a, b = random_adapter(base, 4), random_adapter(base, 5)

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path, max_loaded_loras=1) as engine:
            await engine.load_adapter("A", "inc.aaaaaaaa:1", a)
            await engine.load_adapter("B", "inc.bbbbbbbb:1", b)
            only_b = sorted(app._known)
            resp = await engine.complete(_req(version="inc.aaaaaaaa:1", max_tokens=5, seed=2))
            return only_b, resp, sorted(app._known)

    only_b, resp, only_a = asyncio.run(main())
    assert only_b == ["bbbbbbbb-v1"] and only_a == ["aaaaaaaa-v1"]
    assert _close(resp.tokens, with_adapter(base, a))


def test_a_restarted_engine_reloads_the_base_and_unloads_left_adapters(fake, tiny_model_dir, tmp_path, base):
    app, url = fake

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path / "one") as first:
            await first.swap_weights("old:1", perturbed(base, 6))
        moved = app.weight_version
        async with _engine(url, tiny_model_dir, tmp_path / "two", version="lora:0") as lora:
            await lora.load_adapter("A", "lora.aaaaaaaa:1", random_adapter(base, 7))
        left = sorted(app._known)
        async with _engine(url, tiny_model_dir, tmp_path / "three", version="again:0") as second:
            resp = await second.complete(_req(max_tokens=5, seed=4))
        return moved, left, resp

    moved, left, resp = asyncio.run(main())
    assert moved == "old:1" and left == ["aaaaaaaa-v1"] and sorted(app._known) == []
    assert resp.tokens.version == "again:0" and app.weight_version == "again:0"
    assert _close(resp.tokens, base)


def test_a_server_on_a_model_that_ties_its_embeddings_refuses_full_weight_releases_naming_the_fix(tiny_model_dir,
                                                                                                  tmp_path, base):
    """vLLM 0.32 reloads a tied output head from nothing (the fake does as it does): a full-weight release would be
    served with the base model's head, so it is refused before anything reaches the server; LoRA releases serve."""
    app = FakeVLLM(tiny_model_dir)  # the tied model itself

    async def main():
        with serve_asgi(app) as url:
            async with _engine(url, tiny_model_dir, tmp_path) as engine:
                with pytest.raises(UpstreamError, match="ties its embeddings.*reef_core.engines.untie"):
                    await engine.swap_weights("inc:1", perturbed(base, 1))
                await engine.load_adapter("A", "inc.aaaaaaaa:1", random_adapter(base, 1))
                return engine.version, await engine.complete(_req(version="inc.aaaaaaaa:1", max_tokens=4, seed=1))

    version, resp = asyncio.run(main())
    assert version == "inc:0" and app.stats["reloads"] == 0 and resp.tokens.version == "inc.aaaaaaaa:1"


def test_a_release_over_the_untied_copy_serves_the_tied_model_it_was_trained_as(fake, tiny_model_dir, tmp_path,
                                                                                base):
    app, url = fake
    moved = perturbed(base, 5)  # the embeddings move, and with them the tied head

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path) as engine:
            await engine.swap_weights("inc:1", moved)
            return await engine.complete(_req(max_tokens=6, temperature=1.0, seed=2))

    resp = asyncio.run(main())
    trained = copy.deepcopy(base)
    trained.load_state_dict(moved)
    assert _close(resp.tokens, trained)
    assert torch.equal(app.model.lm_head.weight, app.model.model.embed_tokens.weight)
