"""engine.kind=vllm from config: registration, validation of its keys (each error names its key) and managed start
(engine.launch runs `python -m vllm.entrypoints.openai.api_server --model <model>` with the variables vLLM needs; tests launch
FakeVLLM as that module)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from reef_core.builtins.engines import make_vllm_engine
from reef_core.config.schema import EngineConfig
from reef_core.engines.base import EngineRequest
from reef_core.engines.launch import launcher_from_config
from reef_core.engines.vllm import VLLMEngine
from reef_core.errors import ConfigError, UpstreamError


def _config(model_dir, **kw):
    return EngineConfig(kind="vllm", model=str(model_dir), **kw)


def test_the_vllm_kind_is_registered():
    from reef_core.plugins import PluginManager

    pm = PluginManager()
    assert pm.get("engine", "vllm").factory is make_vllm_engine


@pytest.mark.parametrize("kw, key", [
    ({}, "engine.url"),
    ({"url": "http://127.0.0.1:1", "launch": {"python": sys.executable}}, "engine.launch"),
    ({"launch": {"python": "/nonexistent/python"}}, "engine.launch.python"),
    ({"url": "http://127.0.0.1:1", "max_loaded_loras": 0}, "engine.max_loaded_loras"),
    ({"url": "http://127.0.0.1:1", "top_k_logprobs": 65}, "engine.top_k_logprobs"),
])
def test_invalid_settings_are_refused_naming_the_key(tiny_model_dir, tmp_path, kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make_vllm_engine(_config(tiny_model_dir, **kw), tmp_path)


def test_the_launch_command_is_the_openai_api_server_with_its_variables(tiny_model_dir):
    launcher = launcher_from_config({"python": sys.executable, "args": ["--enable-lora"]}, tiny_model_dir, "vllm")
    assert launcher.command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir)]
    assert launcher.command[-1] == "--enable-lora" and "--model-path" not in launcher.command


def test_managed_start_launches_waits_serves_and_stops(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, launch={"python": sys.executable, "module": "reef_core.testing.fake_vllm",
                                             "args": ["--enable-lora"]}, ready_timeout_s=120)
    engine = make_vllm_engine(config, tmp_path)
    assert isinstance(engine, VLLMEngine)
    launcher = engine.launcher

    async def main():
        async with engine:
            assert launcher.running()
            resp = await engine.complete(EngineRequest("openai", "chat", {
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
            await engine.swap_weights("x:1", None)  # the dev-mode routes the launcher enabled
            return resp

    resp = asyncio.run(main())
    assert resp.status == 200 and resp.tokens is not None and resp.tokens.version == resp.version
    assert not launcher.running()


def test_a_managed_server_that_goes_down_in_a_reload_is_started_again_on_the_old_release(tiny_model_dir,
                                                                                             tmp_path):
    """A managed server that goes down during a reload is started again and loaded with the release that served
    before, under its label, so the next request is served by it."""
    import httpx
    import torch

    from reef_core.models.loading import load_model
    from reef_core.testing.remote_checks import perturbed, reference_logprobs

    base = load_model(tiny_model_dir)[0]
    good = perturbed(base, 1)
    config = _config(tiny_model_dir, launch={"python": sys.executable, "module": "reef_core.testing.fake_vllm"},
                     ready_timeout_s=120, weights_dir=str(tmp_path / "weights"))
    engine = make_vllm_engine(config, tmp_path)
    launcher = engine.launcher

    async def main():
        async with engine:
            await engine.swap_weights("x:1", good)
            first = launcher._proc.pid
            httpx.post(f"{launcher.url}/_fake/faults", json={"op": "reload_weights", "crash": True})
            with pytest.raises(UpstreamError, match="injected failure"):
                await engine.swap_weights("x:2", perturbed(base, 2))
            stats = httpx.get(f"{launcher.url}/_fake/stats").json()
            resp = await engine.complete(EngineRequest("openai", "chat", {
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
            return first, launcher._proc.pid, stats, resp

    first, second, stats, resp = asyncio.run(main())
    assert second != first  # a new server process
    assert stats["weight_version"] == "x:1" and stats["load_path"].endswith("x_1") and stats["crashed"] is None
    served = load_model(tiny_model_dir)[0]
    served.load_state_dict(good)
    chosen, _ = reference_logprobs(served, resp.tokens.prompt_ids, resp.tokens.output_ids)
    assert resp.tokens.version == "x:1"
    assert torch.allclose(torch.tensor(resp.tokens.output_logprobs), chosen, atol=1e-4)
