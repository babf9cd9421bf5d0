"""Llama checkpoints stored in bf16, loaded for the local engine without transformers' modeling code.

Why: ``reef serve``'s start-up (issue #23) spent 2-4 s importing transformers' model classes (their module-level
imports pull in ``torch.distributed.tensor``, ``sympy`` and ``torch._dynamo``) and ~1 s in transformers' loading
machinery, for a model the engine serves through its own decode pass (:mod:`reef_core.engines.decode`), which reads
only the weights. :func:`load` builds the module tree that pass reads with transformers' attribute and parameter names
(so state dicts, weight swaps and :class:`~reef_core.engines.decode.FastDecoder` see what a transformers model shows
them), float32 weights converted from the checkpoint's bf16 (exact), and the rotary angles computed as transformers'
``LlamaRotaryEmbedding`` computes them. The engine swaps in the transformers model the first time it needs
transformers' forward or peft (a LoRA adapter, a path the lean pass refuses):
:meth:`reef_core.engines.local.LocalEngine._transformers`.

Only what the lean pass computes exactly is taken: a ``llama`` config with SiLU, default rope given as
``rope_parameters``, ``pretraining_tp`` 1, no attention or MLP bias, one ``model.safetensors`` stored in bf16 holding
exactly the model's tensors. Anything else (float32 checkpoints among them: Reef's tiny models, trained releases)
returns None and loads through transformers as before. :func:`load_tokenizer` loads a ``PreTrainedTokenizerFast``
directory through :mod:`reef_core.models.tokenizer` (the ``tokenizers`` library, no transformers import), else by
that class, which is what ``AutoTokenizer`` resolves it to, without the model config it would read first.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

WEIGHTS = "model.safetensors"
_FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


class _Linear(nn.Module):
    """A weight ``[out, in]`` without bias (also the embedding's table): torch's own Linear and Embedding would
    initialise it at construction, which on the meta device imports ``torch._dynamo`` (seconds)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, device="meta"))
        self.bias = None


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.variance_epsilon = eps


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj, self.k_proj = _Linear(hidden, heads * head_dim), _Linear(hidden, kv_heads * head_dim)
        self.v_proj, self.o_proj = _Linear(hidden, kv_heads * head_dim), _Linear(heads * head_dim, hidden)
        self.scaling = head_dim ** -0.5


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _Linear(hidden, inter), _Linear(hidden, inter), _Linear(inter, hidden)


class _Layer(nn.Module):
    def __init__(self, cfg, head_dim: int):
        super().__init__()
        self.self_attn = _Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)


class _Rotary(nn.Module):
    """transformers' default rope: the same inverse frequencies and the same operations, so the same angles."""

    def __init__(self, theta: float, head_dim: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class _Body(nn.Module):
    def __init__(self, cfg, head_dim: int):
        super().__init__()
        self.embed_tokens = _Linear(cfg.hidden_size, cfg.vocab_size)  # [vocab, hidden], as nn.Embedding holds it
        self.layers = nn.ModuleList(_Layer(cfg, head_dim) for _ in range(cfg.num_hidden_layers))
        self.norm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = _Rotary(float(cfg.rope_parameters["rope_theta"]), head_dim)


class LeanLlama(nn.Module):
    """A Llama causal LM's weights in transformers' layout (``model.*``, ``lm_head``), for the engine's decode pass;
    it has no forward of its own."""

    def __init__(self, cfg, generation_config):
        super().__init__()
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.config, self.generation_config = cfg, generation_config
        self.model = _Body(cfg, head_dim)
        self.lm_head = _Linear(cfg.hidden_size, cfg.vocab_size)


def _config(model_dir: Path):
    """The config as attributes when the lean loader takes this model, else None."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    rope = raw.get("rope_parameters")
    ints = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
            "vocab_size")
    if (raw.get("model_type") != "llama" or raw.get("dtype", raw.get("torch_dtype")) != "bfloat16"
            or raw.get("hidden_act", "silu") != "silu" or raw.get("pretraining_tp", 1) != 1
            or raw.get("attention_bias") or raw.get("mlp_bias") or raw.get("rope_scaling")
            or not isinstance(rope, dict) or set(rope) != {"rope_type", "rope_theta"} or rope["rope_type"] != "default"
            or not all(isinstance(raw.get(k), int) and raw[k] > 0 for k in ints)
            or not isinstance(raw.get("rms_norm_eps"), (int, float))):
        return None
    return SimpleNamespace(**{"tie_word_embeddings": False, **raw})


def _generation_config(model_dir: Path, cfg) -> SimpleNamespace:
    """The end-of-sequence ids as transformers reads them: ``generation_config.json``, else the model config."""
    try:
        raw = json.loads((model_dir / "generation_config.json").read_text())
    except FileNotFoundError:
        raw = {"eos_token_id": getattr(cfg, "eos_token_id", None)}
    return SimpleNamespace(eos_token_id=raw.get("eos_token_id"))


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(value))


def load(model_dir: Path) -> LeanLlama | None:
    """The model of ``model_dir`` in float32 on the CPU, in eval mode; None when the lean loader does not take it
    (see the module docstring)."""
    model_dir = Path(model_dir)
    cfg = _config(model_dir)
    if cfg is None or not (model_dir / WEIGHTS).is_file():
        return None
    from safetensors import safe_open

    model = LeanLlama(cfg, _generation_config(model_dir, cfg))
    names = dict(model.named_parameters(remove_duplicate=False))
    expected = {n for n in names if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    with safe_open(str(model_dir / WEIGHTS), framework="pt") as fh:
        if set(fh.keys()) != expected:
            return None
        for name in sorted(expected):
            value = fh.get_tensor(name)
            if value.dtype != torch.bfloat16 or tuple(value.shape) != tuple(names[name].shape):
                return None
            _set(model, name, value.to(torch.float32))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_tokenizer(model_dir: Path):
    """The tokenizer of ``model_dir``, as ``AutoTokenizer.from_pretrained`` loads it: through the ``tokenizers``
    library alone when :mod:`reef_core.models.tokenizer` reproduces it exactly (no transformers import at start-up),
    else transformers' own."""
    from reef_core.models import tokenizer

    lean = tokenizer.load(model_dir)
    if lean is not None:
        return lean
    try:
        cls = json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in _FAST_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
