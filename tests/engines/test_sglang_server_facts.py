"""SGLangEngine against what the real SGLang does (issue #34; FakeSGLang follows its source): a full-weight publish
while other requests run, incremental streaming output, seeds, the served model's identity, the adapter config
SGLang's LoRA loader reads, and paths the server resolves in its own working directory."""

from __future__ import annotations

import asyncio
import copy
import logging
import shutil
import threading
import time

import httpx
import pytest
import torch

from reef_core.engines.base import TOKENS_EVENT, EngineRequest
from reef_core.engines.remote import RemoteOptions
from reef_core.engines.sglang import SGLangEngine
from reef_core.errors import ConfigError
from reef_core.testing import serve_asgi
from reef_core.testing.fake_sglang import FakeSGLang
from reef_core.testing.remote_checks import perturbed, random_adapter, reference_logprobs

MESSAGES = [{"role": "user", "content": "Count from one to ten."}]


def _req(tokens=True, version=None, **body):
    return EngineRequest("openai", "chat", {"model": "tiny", "messages": MESSAGES, **body}, {}, tokens=tokens,
                         version=version)


def _engine(url, model_dir, weights_dir, **kw):
    return SGLangEngine(url, model_dir, version=kw.pop("version", "inc:0"), weights_dir=weights_dir,
                        options=RemoteOptions(ready_timeout_s=10, **kw))


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from reef_core.models.loading import load_model

    return load_model(tiny_model_dir)[0]


async def _until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# ---- M1: a flush needs an empty scheduler ------------------------------------------------------------------
def test_a_publish_while_another_scenario_streams_waits_for_it_and_the_server_survives(tiny_model_dir, tmp_path,
                                                                                         base):
    app = FakeSGLang(tiny_model_dir)
    new_state = perturbed(base, 11)

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path / "w") as engine:
            app.token_delay_s = 0.03

            async def passthrough():
                return [ev async for ev in engine.stream(_req(tokens=False, stream=True, max_tokens=30))]

            streaming = asyncio.create_task(passthrough())
            await _until(lambda: app.in_flight, "the pass-through stream to reach the server")
            await engine.swap_weights("inc:1", new_state)
            assert streaming.done(), "the publish must let the pass-through stream finish first"
            app.token_delay_s = 0.0
            after = await engine.complete(_req(max_tokens=4))
            return await streaming, after

    with serve_asgi(app) as url:
        events, after = asyncio.run(main())
    assert app.crashed is None and app.weight_version == "inc:1" and app.paused is None
    finishes = [c["finish_reason"] for ev in events if isinstance(ev.data, dict)
                for c in ev.data.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["length"]  # not aborted: it drained
    assert after.tokens.version == "inc:1"


def test_requests_reef_cannot_drain_are_aborted_before_the_flush(tiny_model_dir, tmp_path, base):
    app = FakeSGLang(tiny_model_dir)
    done = {}

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path / "w", drain_timeout_s=0.5) as engine:
            app.token_delay_s = 0.05
            other = threading.Thread(target=lambda: done.setdefault("r", httpx.post(  # a client beside Reef
                f"{url}/generate", timeout=60, json={"input_ids": [1, 2, 3], "sampling_params": {
                    "max_new_tokens": 500, "ignore_eos": True}})))
            other.start()
            await _until(lambda: app.in_flight, "the other client's request")
            await engine.swap_weights("inc:1", perturbed(base, 12))
            await asyncio.to_thread(other.join, 30)

    with serve_asgi(app) as url:
        asyncio.run(main())
    assert app.crashed is None and app.weight_version == "inc:1"
    assert done["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"


# ---- M2: incremental streaming output ------------------------------------------------------------------------
def test_an_incremental_streaming_server_records_the_same_tokens(tiny_model_dir, tmp_path, base):
    app = FakeSGLang(tiny_model_dir, incremental_streaming_output=True)

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path / "w", top_k_logprobs=3) as engine:
            plain = await engine.complete(_req(temperature=0, max_tokens=8))
            events = [ev async for ev in engine.stream(_req(temperature=0, max_tokens=8, stream=True))]
            return plain, events

    with serve_asgi(app) as url:
        plain, events = asyncio.run(main())
    tokens = next(ev.data for ev in events if ev.event == TOKENS_EVENT)
    assert tokens["output_ids"] == plain.tokens.output_ids and len(tokens["output_ids"]) == 8
    chosen, _ = reference_logprobs(base, tokens["prompt_ids"], tokens["output_ids"])
    assert torch.allclose(torch.tensor(tokens["output_logprobs"]), chosen, atol=1e-4)
    text = "".join(ev.data["choices"][0]["delta"].get("content") or "" for ev in events
                   if isinstance(ev.data, dict) and ev.data.get("choices"))
    assert text == plain.body["choices"][0]["message"]["content"]


# ---- M3: seeds -----------------------------------------------------------------------------------------------
def test_engine_seeds_fit_the_servers_int32_seed_and_repeat(tiny_model_dir, tmp_path):
    app = FakeSGLang(tiny_model_dir, deterministic_inference=True)

    async def run_once(weights_dir):
        async with _engine(url, tiny_model_dir, weights_dir, seed=0) as engine:
            return [(await engine.complete(_req(temperature=1.0, max_tokens=6))).tokens.output_ids for _ in range(2)]

    with serve_asgi(app) as url:
        first = asyncio.run(run_once(tmp_path / "a"))
        again = asyncio.run(run_once(tmp_path / "b"))
    assert app.crashed is None and first == again
    sent = [e["body"]["sampling_params"]["sampling_seed"] for e in app.log if e["route"] == "generate"
            and "sampling_seed" in e["body"]["sampling_params"]]
    assert sent and all(0 <= s < 2 ** 31 for s in sent)


def test_a_server_that_ignores_seeds_is_named_at_start_up(tiny_model_dir, tmp_path, caplog):
    with serve_asgi(FakeSGLang(tiny_model_dir)) as url, caplog.at_level(logging.WARNING, "reef.engines.sglang"):
        asyncio.run(_engine(url, tiny_model_dir, tmp_path / "w", seed=0).start())
    assert any("--enable-deterministic-inference" in r.getMessage() for r in caplog.records)


# ---- M4: the served model is engine.model -------------------------------------------------------------------
def _other_model(tiny_model_dir, target, base):
    shutil.copytree(tiny_model_dir, target)
    other = copy.deepcopy(base)
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    other.save_pretrained(target)
    return target


def test_a_server_serving_another_model_is_refused_naming_it(tiny_model_dir, tmp_path, base):
    other = _other_model(tiny_model_dir, tmp_path / "other", base)
    with serve_asgi(FakeSGLang(other)) as url:
        with pytest.raises(ConfigError, match=str(tiny_model_dir)):
            asyncio.run(_engine(url, tiny_model_dir, tmp_path / "w").start())
        asyncio.run(_engine(url, tiny_model_dir, tmp_path / "w", check_logprobs=False).start())  # the switch


def test_a_bf16_server_of_the_same_model_passes_the_model_check(tiny_model_dir, tmp_path):
    with serve_asgi(FakeSGLang(tiny_model_dir, dtype="bfloat16")) as url:
        asyncio.run(_engine(url, tiny_model_dir, tmp_path / "w").start())


# ---- M5: the adapter config SGLang's LoRA loader reads -----------------------------------------------------------
def test_adapter_configs_name_short_modules_and_unloadable_ones_are_refused(tiny_model_dir, tmp_path, base):
    import json

    from reef_core.models.adapter import AdapterWeights

    app = FakeSGLang(tiny_model_dir)
    adapter = random_adapter(base, 3)
    assert any("." in m for m in adapter.config["target_modules"])  # peft writes full paths for all-linear

    async def main():
        async with _engine(url, tiny_model_dir, tmp_path / "w") as engine:
            await engine.load_adapter("A", "inc.aaaaaaaa:1", adapter)
            written = json.loads((tmp_path / "w" / "adapters" / "aaaaaaaa-v1" / "adapter_config.json").read_text())
            refused = {}
            for field, value in (("use_rslora", True), ("use_dora", True), ("bias", "all"),
                                 ("modules_to_save", ["lm_head"]), ("layers_to_transform", [0])):
                bad = AdapterWeights({**adapter.config, field: value}, adapter.tensors)
                with pytest.raises(ConfigError) as err:
                    await engine.load_adapter("B", f"inc.bbbbbbbb:{len(refused) + 1}", bad)
                refused[field] = err.value.message
            return written, refused

    with serve_asgi(app) as url:
        written, refused = asyncio.run(main())
    assert sorted(written["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                  "v_proj"]
    assert all(field in message for field, message in refused.items())
    assert app.loaded_adapters() == ["aaaaaaaa-v1"]


# ---- paths the server resolves -------------------------------------------------------------------------------
def test_releases_are_named_by_absolute_paths(tiny_model_dir, tmp_path, base, monkeypatch):
    (tmp_path / "reef").mkdir()
    monkeypatch.chdir(tmp_path / "reef")  # Reef's relative engine.weights_dir ...
    app = FakeSGLang(tiny_model_dir, cwd=tmp_path)  # ... means another directory to the server

    async def main():
        async with _engine(url, tiny_model_dir, "weights") as engine:
            await engine.swap_weights("inc:1", perturbed(base, 13))
            await engine.swap_weights("inc:2", None)
            await engine.load_adapter("A", "inc.aaaaaaaa:1", random_adapter(base, 4))

    with serve_asgi(app) as url:
        asyncio.run(main())
    assert app.weight_version == "inc:2" and app.loaded_adapters() == ["aaaaaaaa-v1"]
