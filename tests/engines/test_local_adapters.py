"""LocalEngine with named LoRA adapters kept unmerged: each request is served by the adapter its version names."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from reef_core.models.adapter import AdapterWeights
from reef_core.engines.base import EngineRequest
from reef_core.engines.local import LocalEngine
from reef_core.errors import Conflict, ValidationFailed

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _req(version=None, **body):
    return EngineRequest("openai", "chat", {"model": "tiny", "messages": MESSAGES, "temperature": 0, **body}, {},
                         version=version)


def _config(rank=4):
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    return {k: (v.value if hasattr(v, "value") else sorted(v) if isinstance(v, set) else v)
            for k, v in config.to_dict().items()}


def _adapter(base, seed, rank=4):
    """A random (non-zero) LoRA adapter for ``base``, built by peft directly."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=8, target_modules="all-linear",
                                                                task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return AdapterWeights(_config(rank), {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()})


def _reference(base, adapter: AdapterWeights | None):
    """base (+ the adapter through peft's own loading), for log-probs computed outside the engine."""
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    model = copy.deepcopy(base)
    if adapter is None:
        return model
    peft_model = get_peft_model(model, PeftConfig.from_peft_type(**adapter.config))
    set_peft_model_state_dict(peft_model, dict(adapter.tensors))
    return peft_model.eval()


def _logprobs(model, prompt_ids, output_ids):
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp[torch.arange(len(output_ids)), torch.tensor(output_ids)], lp


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from reef_core.models.loading import load_model

    model, _ = load_model(tiny_model_dir)
    return model.eval()


def _engine(tiny_model_dir):
    return LocalEngine(tiny_model_dir, max_new_tokens=12, version="inc:0", top_k_logprobs=3)


def test_each_adapter_serves_its_own_distribution_and_the_base_is_untouched(tiny_model_dir, base):
    a, b = _adapter(base, 1), _adapter(base, 2)

    async def go():
        async with _engine(tiny_model_dir) as eng:
            plain = await eng.complete(_req("inc:0"))
            await eng.load_adapter("A", "inc.a:1", a)
            await eng.load_adapter("B", "inc.b:1", b)
            out = {v: await eng.complete(_req(v)) for v in ("inc.a:1", "inc.b:1", "inc:0", None, "unknown")}
            return plain, out, eng.adapters()

    plain, out, adapters = asyncio.run(go())
    assert adapters == {"A": "inc.a:1", "B": "inc.b:1"}
    for version, adapter in (("inc.a:1", a), ("inc.b:1", b), ("inc:0", None)):
        tokens = out[version].tokens
        assert tokens.version == out[version].version == version
        assert out[version].body["system_fingerprint"] == f"reef-{version}"
        expected, full = _logprobs(_reference(base, adapter), tokens.prompt_ids, tokens.output_ids)
        assert torch.allclose(torch.tensor(tokens.output_logprobs), expected, atol=1e-4), version
        top = torch.tensor(tokens.top_k.logprobs).view(len(tokens.output_ids), 3)
        assert torch.allclose(top, full.topk(3).values, atol=1e-4)  # top-K from the same adapter
    # the adapters change what is generated; the base (any version no adapter serves) is exactly as before
    assert out["inc.a:1"].tokens.output_logprobs != out["inc.b:1"].tokens.output_logprobs
    for version in ("inc:0", None, "unknown"):
        assert out[version].tokens.output_ids == plain.tokens.output_ids
        assert out[version].tokens.output_logprobs == pytest.approx(plain.tokens.output_logprobs, abs=1e-6)
        assert out[version].version == "inc:0"


def test_replacing_an_adapter_serves_the_new_one_and_queued_requests_name_what_served_them(tiny_model_dir, base):
    a1, a2, b = _adapter(base, 1), _adapter(base, 3), _adapter(base, 2)

    async def go():
        async with _engine(tiny_model_dir) as eng:
            await eng.load_adapter("A", "inc.a:1", a1)
            await eng.load_adapter("B", "inc.b:1", b)
            first = await eng.complete(_req("inc.a:1"))
            # queued in this order on the single worker: the first request runs before the replacement
            before, _, after = await asyncio.gather(eng.complete(_req("inc.a:1")), eng.load_adapter("A", "inc.a:2", a2),
                                                    eng.complete(_req("inc.a:1")))
            other = await eng.complete(_req("inc.b:1"))
            await eng.load_adapter("A", "inc.a:3", None)  # back to the base, on A's own version line
            rolled = await eng.complete(_req("inc.a:2"))
            await eng.drop_adapter("B")
            dropped = await eng.complete(_req("inc.b:1"))
            plain = await eng.complete(_req(None))
            return first, before, after, other, rolled, dropped, plain

    first, before, after, other, rolled, dropped, plain = asyncio.run(go())
    assert before.version == "inc.a:1" and before.tokens.output_logprobs == pytest.approx(first.tokens.output_logprobs)
    assert after.version == "inc.a:2"  # frozen on A's older version, served (and recorded) by A's current one
    expected, _ = _logprobs(_reference(base, a2), after.tokens.prompt_ids, after.tokens.output_ids)
    assert torch.allclose(torch.tensor(after.tokens.output_logprobs), expected, atol=1e-4)
    expected, _ = _logprobs(_reference(base, b), other.tokens.prompt_ids, other.tokens.output_ids)
    assert torch.allclose(torch.tensor(other.tokens.output_logprobs), expected, atol=1e-4)  # B untouched
    assert rolled.version == "inc.a:3" and dropped.version == "inc:0"
    for res in (rolled, dropped):
        assert res.tokens.output_ids == plain.tokens.output_ids
        assert res.tokens.output_logprobs == pytest.approx(plain.tokens.output_logprobs, abs=1e-6)


def test_full_swap_is_refused_while_adapters_exist_and_bad_adapters_change_nothing(tiny_model_dir, base):
    a, wider = _adapter(base, 1), _adapter(base, 4, rank=8)

    async def go():
        async with _engine(tiny_model_dir) as eng:
            await eng.load_adapter("A", "inc.a:1", a)
            before = await eng.complete(_req("inc.a:1"))
            state = {"model.norm.weight": torch.ones_like(base.state_dict()["model.norm.weight"])}
            with pytest.raises(Conflict, match="LoRA adapters \\(A\\)"):
                await eng.swap_weights("inc:1", state)
            wrong = AdapterWeights(a.config, {k: torch.zeros(3, 3) for k in a.tensors})
            with pytest.raises(ValidationFailed, match="shapes"):
                await eng.load_adapter("A", "inc.a:2", wrong)
            with pytest.raises(ValidationFailed, match="unknown"):
                await eng.load_adapter("C", "inc.c:1", AdapterWeights(a.config, {"nope": torch.zeros(1)}))
            after = await eng.complete(_req("inc.a:1"))
            adapters = eng.adapters()
            await eng.load_adapter("A", "inc.a:2", wider)  # another config: a new slot replaces the old one
            widened = await eng.complete(_req("inc.a:1"))
            await eng.drop_adapter("A")
            await eng.swap_weights("inc:1", state)  # no adapter left: full swaps work again
            return before, after, adapters, widened, eng.version

    before, after, adapters, widened, version = asyncio.run(go())
    assert version == "inc:1" and adapters == {"A": "inc.a:1"}
    assert after.tokens.output_logprobs == pytest.approx(before.tokens.output_logprobs)
    expected, _ = _logprobs(_reference(base, wider), widened.tokens.prompt_ids, widened.tokens.output_ids)
    assert widened.version == "inc.a:2"
    assert torch.allclose(torch.tensor(widened.tokens.output_logprobs), expected, atol=1e-4)
