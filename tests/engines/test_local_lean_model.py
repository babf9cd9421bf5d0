"""The lean loader of bf16 Llama checkpoints (reef_core/engines/lean_model.py): the same float32 weights, rotary angles
and end-of-sequence ids transformers gives, the same tokenizer, and an engine that serves exactly what an engine on
the transformers model serves -- after a weight swap too -- and swaps in the transformers model, weights kept, when its
forward or a LoRA adapter is needed. Checkpoints it does not take load through transformers as before."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

from reef_core.engines import lean_model
from reef_core.models.adapter import AdapterWeights
from reef_core.engines.base import EngineRequest
from reef_core.engines.decode import supports
from reef_core.engines.local import LocalEngine
from reef_core.models.loading import build_tiny_model, load_model, save_tokenizer

BODY = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}], "seed": 11,
        "temperature": 1.0, "max_tokens": 10, "logprobs": True, "top_logprobs": 2}


def _save(path, arch="llama", dtype=torch.bfloat16):
    model, tok = build_tiny_model(seed=5, arch=arch, hidden_size=64, num_layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # a less flat distribution than the random init
    model.to(dtype).save_pretrained(path)
    save_tokenizer(tok, path)
    return path


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("models") / "tiny-llama-bf16-checkpoint")


def test_the_lean_model_holds_what_transformers_loads(bf16_dir):
    lean = lean_model.load(bf16_dir)
    full, _ = load_model(bf16_dir)
    assert isinstance(lean, lean_model.LeanLlama) and supports(lean) is None
    ours, theirs = lean.state_dict(), full.state_dict()
    assert set(ours) == set(theirs)
    assert all(ours[k].dtype == torch.float32 and torch.equal(ours[k], theirs[k]) for k in theirs)
    assert lean.lm_head.weight is lean.model.embed_tokens.weight  # tied, like transformers' model
    x = torch.empty(1, 1, 1)
    pos = torch.arange(50)[None]
    for a, b in zip(lean.model.rotary_emb(x, pos), full.model.rotary_emb(x, pos)):
        assert torch.equal(a, b)
    assert lean.generation_config.eos_token_id == full.generation_config.eos_token_id
    assert lean.config.max_position_embeddings == full.config.max_position_embeddings


def test_the_tokenizer_is_the_one_auto_tokenizer_loads(bf16_dir):
    from transformers import AutoTokenizer

    from reef_core.models.tokenizer import LeanTokenizer

    ours, theirs = lean_model.load_tokenizer(bf16_dir), AutoTokenizer.from_pretrained(bf16_dir)
    assert isinstance(ours, LeanTokenizer)  # without transformers (tests/models/test_lean_tokenizer.py compares more)
    text = theirs.apply_chat_template(BODY["messages"], add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(BODY["messages"], add_generation_prompt=True, tokenize=False) == text
    ids = theirs(text, add_special_tokens=False)["input_ids"]
    assert ours(text, add_special_tokens=False)["input_ids"] == ids
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.get_vocab() == theirs.get_vocab() and ours.eos_token_id == theirs.eos_token_id


def test_checkpoints_it_does_not_take_load_through_transformers(tmp_path, bf16_dir):
    assert lean_model.load(_save(tmp_path / "f32", dtype=torch.float32)) is None
    assert lean_model.load(_save(tmp_path / "qwen2", arch="qwen2")) is None
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in bf16_dir.iterdir():
        (scaled / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((scaled / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(cfg))
    assert lean_model.load(scaled) is None
    from safetensors.torch import load_file, save_file

    extra = tmp_path / "extra"
    extra.mkdir()
    for f in bf16_dir.iterdir():
        (extra / f.name).write_bytes(f.read_bytes())
    tensors = load_file(extra / "model.safetensors")
    tensors["model.unexpected.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(tensors, extra / "model.safetensors")
    assert lean_model.load(extra) is None


def _req():
    return EngineRequest("openai", "chat", dict(BODY), {})


def _serve(model_dir, monkeypatch, lean: bool, swap=None, adapter=None):
    """(responses, model class names) of an engine loaded by the lean loader or by transformers: a lean-path
    request, a transformers-forward one, and, with ``swap`` / ``adapter``, one after a weight swap / adapter load."""
    if not lean:
        monkeypatch.setattr(lean_model, "load", lambda model_dir: None)

    async def go():
        out, kinds = [], []
        async with LocalEngine(model_dir, top_k_logprobs=3) as eng:
            kinds.append(type(eng._model).__name__)
            if swap is not None:
                await eng.swap_weights("v1", swap)
            if adapter is not None:
                await eng.load_adapter("a", "a:1", adapter)
            version = None if adapter is None else "a:1"  # the adapter's version: served by the adapter
            out.append(await eng.complete(EngineRequest("openai", "chat", dict(BODY), {}, version=version)))
            assert eng.decode_path == "lean"
            eng.fast_decode = False
            out.append(await eng.complete(_req()))
            assert eng.decode_path == "transformers"
            kinds.append(type(eng._model if eng._peft is None else eng._peft.base_model.model).__name__)
        return out, kinds

    return asyncio.run(go())


def _same(a, b):
    assert a.tokens.output_ids == b.tokens.output_ids and len(a.tokens.output_ids) > 2
    assert a.tokens.output_logprobs == b.tokens.output_logprobs
    assert a.tokens.top_k.logprobs == b.tokens.top_k.logprobs
    assert a.body["choices"][0] == b.body["choices"][0]


def test_an_engine_on_the_lean_model_serves_what_one_on_transformers_serves(bf16_dir, monkeypatch):
    lean, kinds = _serve(bf16_dir, monkeypatch, lean=True)
    assert kinds == ["LeanLlama", "LlamaForCausalLM"]  # transformers' forward brought in transformers' model
    with monkeypatch.context() as m:
        full, kinds = _serve(bf16_dir, m, lean=False)
    assert kinds == ["LlamaForCausalLM", "LlamaForCausalLM"]
    _same(lean[0], full[0])
    _same(lean[1], full[1])


def test_a_swap_reaches_the_lean_model_and_survives_the_switch_to_transformers(bf16_dir, monkeypatch):
    model, _ = load_model(bf16_dir)
    with torch.no_grad():
        new = {k: v + 1e-2 * torch.randn_like(v) for k, v in model.state_dict().items() if "mlp" in k}
    lean, _ = _serve(bf16_dir, monkeypatch, lean=True, swap=new)
    with monkeypatch.context() as m:
        full, _ = _serve(bf16_dir, m, lean=False, swap=new)
    _same(lean[0], full[0])
    _same(lean[1], full[1])  # the transformers model took the swapped weights over


@pytest.mark.parametrize("layers", [None, 1])  # every layer, or the top one only (trainer.lora_layers)
def test_a_lora_adapter_on_the_lean_model_is_served_as_on_transformers(bf16_dir, monkeypatch, layers):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from reef_core.grow.objective import lora_targets

    base, _ = load_model(bf16_dir)
    targets = lora_targets(base, "all-linear", layers)
    torch.manual_seed(2)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    config = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **targets).to_dict()
    config = {k: (v.value if hasattr(v, "value") else sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    adapter = AdapterWeights(config, {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()})
    lean, kinds = _serve(bf16_dir, monkeypatch, lean=True, adapter=adapter)
    assert kinds[0] == "LeanLlama" and kinds[1] == "LlamaForCausalLM"
    with monkeypatch.context() as m:
        full, _ = _serve(bf16_dir, m, lean=False, adapter=adapter)
    _same(lean[0], full[0])
    _same(lean[1], full[1])
