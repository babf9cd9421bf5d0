"""engine.kind=sglang from config: validation of its keys (each error names its key), managed start (engine.launch)
with FakeSGLang launched as a subprocess, and the tool-call parser."""

from __future__ import annotations

import asyncio
import sys

import pytest

from reef_core.builtins.engines import make_sglang_engine
from reef_core.config.schema import EngineConfig
from reef_core.engines.base import EngineRequest
from reef_core.engines.toolcalls import parse_tool_calls
from reef_core.errors import ConfigError, UpstreamError


def _config(model_dir, **kw):
    return EngineConfig(kind="sglang", model=str(model_dir), **kw)


@pytest.mark.parametrize("kw, key", [
    ({}, "engine.url"),
    ({"url": "ftp://x"}, "engine.url"),
    ({"url": "http://127.0.0.1:1", "launch": {"python": sys.executable}}, "engine.launch"),
    ({"launch": {"python": sys.executable, "bogus": 1}}, "engine.launch"),
    ({"launch": {"python": "/nonexistent/python"}}, "engine.launch.python"),
    ({"launch": {"python": sys.executable, "port": 70000}}, "engine.launch.port"),
    ({"launch": {"python": sys.executable, "args": "--enable-lora"}}, "engine.launch.args"),
    ({"url": "http://127.0.0.1:1", "tool_call_parser": "mystery"}, "engine.tool_call_parser"),
    ({"url": "http://127.0.0.1:1", "max_loaded_loras": 0}, "engine.max_loaded_loras"),
    ({"url": "http://127.0.0.1:1", "drain_timeout_s": 0}, "engine.drain_timeout_s"),
    ({"url": "http://127.0.0.1:1", "top_k_logprobs": 65}, "engine.top_k_logprobs"),
])
def test_invalid_settings_are_refused_naming_the_key(tiny_model_dir, tmp_path, kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make_sglang_engine(_config(tiny_model_dir, **kw), tmp_path)


def test_managed_start_launches_waits_serves_and_stops(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, launch={"python": sys.executable, "module": "reef_core.testing.fake_sglang",
                                             "args": ["--enable-lora"]}, ready_timeout_s=120)
    engine = make_sglang_engine(config, tmp_path)
    launcher = engine.launcher
    assert launcher.url.startswith("http://127.0.0.1:") and "--model-path" in launcher.command

    async def main():
        async with engine:
            assert launcher.running()
            return await engine.complete(EngineRequest("openai", "chat", {
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))

    resp = asyncio.run(main())
    assert resp.status == 200 and resp.tokens is not None and resp.tokens.version == engine.version
    assert not launcher.running()


def test_a_server_that_exits_before_ready_fails_fast_with_its_output(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, launch={"python": sys.executable, "module": "reef_core.no_such_server"},
                     ready_timeout_s=120)
    engine = make_sglang_engine(config, tmp_path)
    with pytest.raises(UpstreamError, match="No module named"):
        asyncio.run(engine.start())
    assert not engine.launcher.running()


def test_hermes_tool_calls_are_parsed_and_the_rest_stays_content():
    text = 'Let me look.<tool_call>\n{"name": "search", "arguments": {"q": "reef"}}\n</tool_call>'
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me look."
    assert calls[0]["function"] == {"name": "search", "arguments": '{"q": "reef"}'} and calls[0]["type"] == "function"
    assert parse_tool_calls("hermes", "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("none", text) == (text, [])


def test_an_engine_that_is_not_started_says_so(tiny_model_dir, tmp_path):
    engine = make_sglang_engine(_config(tiny_model_dir, url="http://127.0.0.1:1"), tmp_path)
    request = EngineRequest("openai", "chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(UpstreamError, match="not started"):
        asyncio.run(engine.complete(request))
