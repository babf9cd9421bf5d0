"""engine.kind=vllm from config: registration, validation of its keys (each error names its key) and managed start
(engine.launch runs `python -m vllm.entrypoints.cli.main serve <model>` with the variables vLLM needs; tests launch
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
from reef_core.errors import ConfigError


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


def test_the_launch_command_is_vllm_serve_with_its_variables(tiny_model_dir):
    launcher = launcher_from_config({"python": sys.executable, "args": ["--enable-lora"]}, tiny_model_dir, "vllm")
    assert launcher.command[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(tiny_model_dir)]
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
