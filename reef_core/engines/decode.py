"""A lean forward pass for decoding Llama-family models (Llama, Qwen2) in the local engine.

Why: a profile of the engine on a 2-core CPU (``bench/profiles/``) shows that, beside the matrix-vector products,
about a third of each decode step went to transformers' module machinery (``Module.__call__``, cache objects,
per-layer config lookups, ``torch.cat`` growing the KV cache), and then, with that gone, to the few hundred small
torch operations of a step. :class:`FastDecoder` computes the same arithmetic over the model's own parameters:

* a static KV cache, allocated once per generation for prompt + budget, written in place;
* rotary tables computed once per generation by the model's own rotary module (so every static rope type the
  model supports gives the same angles);
* prompts (:meth:`FastDecoder.prefill`, several at once: :func:`prefill_rows`) through the C layers, 32 tokens a
  call; without them, through plain tensor ops (one causal SDPA call per layer);
* each decode step through every layer in one C call (:func:`reef_core.engines.kernels.decode_layers`: packed
  weights, attention of each query head over its shared KV head's cache), for one generation or a batch of them
  (:func:`step_rows`); without the C kernel, the same step in tensor ops;
* LoRA adapters (``peft``, unmerged) applied as ``base(x) + scale * B(A(x))`` for the slot the engine enabled.

Numerics are float32 like the trainer's recomputation (:func:`reef_core.grow.logprobs.sequence_logprobs`); only
the order of some reductions differs, far inside the 1e-4 contract. The parameters are read by reference when a
generation starts, so weight swaps (in-place copies, after which the engine clears the packed copies) and adapter
switches between requests are seen at once. :func:`supports` says when the model falls outside what this pass
implements; the engine then keeps transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reef_core.engines import kernels
from reef_core.engines.kernels import PackedMatrix

#: rope types whose angles depend only on the position (not on the sequence length seen so far)
_STATIC_ROPE = {"default", "linear", "llama3"}


def _rope_type(cfg) -> str:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default"))) if isinstance(params, dict) else "?"


def supports(model) -> str | None:
    """None when :class:`FastDecoder` computes ``model`` exactly, else why not (kept for logs and tests)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ("llama", "qwen2"):
        return f"model type {getattr(cfg, 'model_type', None)!r} (llama and qwen2 only)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    if _rope_type(cfg) not in _STATIC_ROPE:
        return f"rope type {_rope_type(cfg)!r}"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "no decoder body"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "parameters are not float32"
    return None


class Packed:
    """Copies of the model's float32 weights in the C kernel's layout (:mod:`reef_core.engines.kernels`; bf16 for the
    weights that are exactly bf16, float32 for the others), kept across generations; :meth:`clear` after any weight
    change."""

    def __init__(self, fn):
        self.fn = fn  # the C kernel, or None: transformers-free decoding on torch's own products
        self._mats: dict[int, tuple[torch.Tensor, PackedMatrix | None]] = {}
        self._transposed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def clear(self) -> None:
        self._mats.clear()
        self._transposed.clear()

    def transposed(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t.T`` (a LoRA B, which the C step reads by rows of its rank), made again after any
        in-place change of ``t`` (a new adapter version is copied into the same tensors)."""
        hit = self._transposed.get(id(t))
        if hit is None or hit[0] is not t or hit[1] != t._version:
            hit = (t, t._version, t.detach().t().contiguous())
            self._transposed[id(t)] = hit
        return hit[2]

    def __len__(self) -> int:
        """How many weights are served from a bf16 copy now."""
        return sum(1 for _, mat in self._mats.values() if mat is not None and not mat.f32)

    def put(self, w: torch.Tensor, mat: PackedMatrix) -> None:
        """Serve ``w`` from ``mat``, a packed copy of its current values made elsewhere (read from a cache)."""
        self._mats[id(w)] = (w, mat)

    def items(self) -> list[tuple[torch.Tensor, PackedMatrix]]:
        """Every weight packed so far, with its packed copy."""
        return list(self._mats.values())

    def get(self, w: torch.Tensor) -> PackedMatrix | None:
        if self.fn is None or w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            return None
        hit = self._mats.get(id(w))
        if hit is None or hit[0] is not w:  # the tensor is held in the entry, so its id is not reused meanwhile
            hit = (w, PackedMatrix(w, self.fn))
            self._mats[id(w)] = hit
        return hit[1]


#: the most rows sent through the kernel at once (a batched decode step, or a piece of a prompt: longer prompts go
#: through the C layers this many tokens a call; the kernel's AMX path holds 32 rows' split activations in its
#: tiles); longer inputs to a single projection use torch's matrix products
MAX_KERNEL_ROWS = 32


class _Proj:
    """One linear projection: the base weight and bias, plus the enabled LoRA pair and its scale (if any).

    With a packed copy of the base weight (``packed``), short inputs (one row, or one per batched generation) go
    through the C kernel; a single row into a buffer of this projection's own (reused every step: each output is
    consumed before the projection runs again)."""

    __slots__ = ("w", "b", "a", "bb", "bt", "scale", "mat", "out")

    def __init__(self, module, slot: str | None, packed: Packed | None = None):
        base = getattr(module, "base_layer", module)  # a peft LoraLayer wraps the original Linear
        self.w, self.b = base.weight, base.bias
        self.mat = packed.get(self.w) if packed is not None else None
        self.out = torch.empty(1, self.w.shape[0]) if self.mat is not None else None
        self.a = self.bb = self.bt = None
        self.scale = 0.0
        if slot is not None and slot in getattr(module, "lora_A", {}):
            if getattr(module, "use_dora", {}).get(slot):
                raise _Unsupported("DoRA adapters")
            self.a, self.bb = module.lora_A[slot].weight, module.lora_B[slot].weight
            self.scale = float(module.scaling[slot])
            if self.mat is not None and self.bb.device.type == "cpu":
                self.bt = packed.transposed(self.bb)  # for the C step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mat is not None and x.shape[0] == 1:
            y = self.mat(x.contiguous(), self.b, self.out)
        elif self.mat is not None and x.shape[0] <= MAX_KERNEL_ROWS:
            y = self.mat(x.contiguous(), self.b, torch.empty(x.shape[0], self.w.shape[0]))
        else:
            y = F.linear(x, self.w, self.b)
        if self.a is not None:
            y = y + F.linear(F.linear(x, self.a), self.bb) * self.scale
        return y


class _Unsupported(Exception):
    pass


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _c_proj(p: _Proj):
    """``p`` as the C step's projection record, or None when it has no packed copy."""
    if p.mat is None or not all(_plain(t) for t in (p.b, p.a, p.bt)) or (p.a is not None and p.bt is None):
        return None
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    return kernels.Proj(p.mat.ptr, ptr(p.b), ptr(p.a), ptr(p.bt), p.mat.n, p.mat.k,
                     p.a.shape[0] if p.a is not None else 0, p.scale, int(p.mat.f32))


class FastDecoder:
    """One generation's forward passes: :meth:`prefill` the prompt, then :meth:`step` one token at a time.

    Build one per generation (cheap: it only collects references), with ``slot`` the peft adapter the engine
    enabled (None: the base). ``length`` bounds prompt + new tokens (the cache is allocated for it).
    """

    def __init__(self, model, slot: str | None, length: int, device: torch.device, packed: Packed | None = None):
        cfg = model.config
        body = model.model
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.groups = self.n_heads // self.n_kv
        self.layers = []
        try:
            for layer in body.layers:
                at, mlp = layer.self_attn, layer.mlp
                self.layers.append((
                    layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon),
                    _Proj(at.q_proj, slot, packed), _Proj(at.k_proj, slot, packed), _Proj(at.v_proj, slot, packed),
                    _Proj(at.o_proj, slot, packed),
                    layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon),
                    _Proj(mlp.gate_proj, slot, packed), _Proj(mlp.up_proj, slot, packed),
                    _Proj(mlp.down_proj, slot, packed),
                ))
            self.head = _Proj(model.lm_head, slot, packed)
        except _Unsupported as exc:
            raise NotImplementedError(str(exc)) from None
        self.embed = body.embed_tokens
        self.embed_w = getattr(self.embed, "base_layer", self.embed).weight
        self.norm_w, self.norm_eps = body.norm.weight, float(body.norm.variance_epsilon)
        n = len(self.layers)
        self.k = torch.empty(n, self.n_kv, length, self.hd, device=device)
        self.v = torch.empty(n, self.n_kv, length, self.hd, device=device)
        pos = torch.arange(length, device=device)[None]
        cos, sin = body.rotary_emb(self.k[0, :1, :1], pos)  # the model's own angles, [1, length, hd]
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        self.pos = 0
        self.scale = float(getattr(body.layers[0].self_attn, "scaling", self.hd ** -0.5))
        self.hidden = int(cfg.hidden_size)
        #: the layers as the C decode step reads them, or None: decode steps run the layers in torch
        self.native = self._native_table()

    def _native_table(self):
        """Every decoder layer's weights as :func:`reef_core.engines.kernels.decode_layers` reads them (pointers into
        the packed copies and the model's own norm and LoRA tensors, valid for this generation), or None when the
        C step cannot run: no kernel, or a projection without a packed copy."""
        if kernels.decode_layers() is None:
            return None
        table = (kernels.Layer * len(self.layers))()
        for row, (w1, e1, q_p, k_p, v_p, o_p, w2, e2, g_p, u_p, d_p) in zip(table, self.layers):
            projs = [_c_proj(p) for p in (q_p, k_p, v_p, o_p, g_p, u_p, d_p)]
            if any(p is None for p in projs) or not (_plain(w1) and _plain(w2)):
                return None
            row.ln1, row.ln2, row.eps1, row.eps2 = w1.data_ptr(), w2.data_ptr(), e1, e2
            for i, p in enumerate(projs):
                row.p[i] = p
        return table

    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, w.shape, w, eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.hd // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` ([T]) at positions pos..pos+T-1 through the model; logits of the last one, float32."""
        t = ids.shape[0]
        p0, p1 = self.pos, self.pos + t
        h = F.embedding(ids, self.embed_w)  # [T, H]
        cos, sin = self.cos[p0:p1], self.sin[p0:p1]  # [T, hd]
        nh, nkv, hd = self.n_heads, self.n_kv, self.hd
        for i, (w1, e1, q_p, k_p, v_p, o_p, w2, e2, g_p, u_p, d_p) in enumerate(self.layers):
            x = self._norm(h, w1, e1)
            q = self._rope(q_p(x).view(t, nh, hd).transpose(0, 1), cos, sin)  # [nh, T, hd]
            k = self._rope(k_p(x).view(t, nkv, hd).transpose(0, 1), cos, sin)  # [nkv, T, hd]
            self.k[i, :, p0:p1] = k
            self.v[i, :, p0:p1] = v_p(x).view(t, nkv, hd).transpose(0, 1)
            keys, values = self.k[i, :, :p1], self.v[i, :, :p1]
            if t == 1:  # each KV head's query heads as a "sequence" of queries over every cached key: no mask
                a = F.scaled_dot_product_attention(q.reshape(nkv, self.groups, hd), keys, values, scale=self.scale)
                a = a.reshape(1, nh * hd)
            else:  # the prompt: causal, from an empty cache
                keys = keys.repeat_interleave(self.groups, dim=0)
                values = values.repeat_interleave(self.groups, dim=0)
                a = F.scaled_dot_product_attention(q, keys, values, is_causal=p0 == 0, scale=self.scale)
                a = a.transpose(0, 1).reshape(t, nh * hd)
            h = h + o_p(a)
            x = self._norm(h, w2, e2)
            h = h + d_p(F.silu(g_p(x)) * u_p(x))
        self.pos = p1
        return self.head(self._norm(h[-1:], self.norm_w, self.norm_eps))[0].float()

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Logits after the prompt ``ids`` (the cache must be empty)."""
        return prefill_rows([self], [ids])[0]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits after one more token (``token``: a 1-element long tensor)."""
        if self.native is not None:
            return _native_step([self], token.view(1))[0]
        return self._forward(token.view(1))


def _native_layers(rows: list[tuple[FastDecoder, int]], tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states after every decoder layer for ``tokens[i]`` at position ``rows[i][1]`` of generation
    ``rows[i][0]``, through the C layers (:func:`reef_core.engines.kernels.decode_layers`), which also write each
    token's key and value into its generation's cache; ``[B, H]`` before the final norm. Rows are taken in order, so
    consecutive positions of one generation (a prompt) attend causally to the rows before them."""
    lead = rows[0][0]
    h = F.embedding(tokens, lead.embed_w).contiguous()  # [B, H], a fresh tensor the C step updates in place
    gens = (kernels.Gen * len(rows))(*[
        kernels.Gen(d.k.data_ptr(), d.v.data_ptr(), d.k.shape[2], pos, d.cos.data_ptr(), d.sin.data_ptr())
        for d, pos in rows])
    if kernels.decode_layers()(lead.native, len(lead.layers), h.data_ptr(), len(rows), lead.hidden, lead.n_heads,
                            lead.n_kv, lead.hd, lead.scale, gens):
        raise MemoryError("decode step: no memory for its buffers")
    return h


def _native_step(decoders: list[FastDecoder], tokens: torch.Tensor) -> torch.Tensor:
    """One decode step of ``decoders`` through the C layers, then the final norm and the head here; ``[B, vocab]``
    float32 logits."""
    lead = decoders[0]
    h = _native_layers([(d, d.pos) for d in decoders], tokens)
    for d in decoders:
        d.pos += 1
    return lead.head(lead._norm(h, lead.norm_w, lead.norm_eps)).float()


def prefill_rows(decoders: list[FastDecoder], prompts: list[list[int]]) -> torch.Tensor:
    """Logits after each prompt, ``prompts[i]`` into ``decoders[i]`` (each cache empty; the decoders share weights and
    adapter, as for :func:`step_rows`); ``[B, vocab]`` float32.

    Through the C layers, the prompts' tokens go as one sequence of rows, :data:`MAX_KERNEL_ROWS` a call, across
    prompts (each call's rows attend causally to the rows of their own generation before them, and to what earlier
    calls cached): several short prompts share the reading of the weights. Each row's arithmetic is what it is
    alone, so a prompt's logits do not depend on the prompts beside it. Without the C layers, each prompt goes
    through torch alone; with portable-C kernels, so does each prompt longer than :data:`MAX_KERNEL_ROWS` (torch's
    matrix products are faster then). The path is chosen per prompt, never per batch: a short prompt takes the
    kernel beside a long one exactly as it does alone."""
    if any(d.pos for d in decoders):
        raise RuntimeError("prefill on a cache already in use")
    if any(not ids for ids in prompts):
        raise ValueError("an empty prompt")
    lead = decoders[0]
    alone = [lead.native is None or (kernels.isa() == "c" and len(ids) > MAX_KERNEL_ROWS) for ids in prompts]
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    for i in (i for i, torch_path in enumerate(alone) if torch_path):
        logits[i] = decoders[i]._forward(torch.tensor(prompts[i], device=decoders[i].k.device))
    shared = [i for i, torch_path in enumerate(alone) if not torch_path]
    if shared:
        for i, row in zip(shared, _prefill_native([decoders[i] for i in shared], [prompts[i] for i in shared])):
            logits[i] = row
    return torch.stack(logits)


def _prefill_native(decoders: list[FastDecoder], prompts: list[list[int]]) -> torch.Tensor:
    """:func:`prefill_rows` through the C layers for all of ``prompts``: ``[B, vocab]`` float32 logits."""
    lead = decoders[0]
    rows = [(d, p) for d, ids in zip(decoders, prompts) for p in range(len(ids))]
    tokens = torch.tensor([t for ids in prompts for t in ids], device=lead.k.device)
    ends, at = [], -1
    for ids in prompts:
        at += len(ids)
        ends.append(at)
    last = []  # each prompt's last row after the layers
    for p0 in range(0, len(rows), MAX_KERNEL_ROWS):
        h = _native_layers(rows[p0:p0 + MAX_KERNEL_ROWS], tokens[p0:p0 + MAX_KERNEL_ROWS])
        last.extend(h[e - p0] for e in ends if p0 <= e < p0 + MAX_KERNEL_ROWS)
    for d, ids in zip(decoders, prompts):
        d.pos = len(ids)
    return lead.head(lead._norm(torch.stack(last), lead.norm_w, lead.norm_eps)).float()


def step_rows(decoders: list[FastDecoder], tokens: torch.Tensor) -> torch.Tensor:
    """One decode step for several generations at once: ``tokens[i]`` goes to ``decoders[i]`` (each at its own
    position, over its own cache); returns their logits, ``[B, vocab]`` float32.

    The decoders must share weights and adapter (built from the same model and slot): the projections run once for
    the whole batch (weights read from memory once per step, not once per generation), attention per generation
    over its own cache (no padding, no mask). Each row's arithmetic is what :meth:`FastDecoder.step` does for it
    alone, up to the reduction order of float32 matrix products (bitwise the same through the C kernel).
    """
    if decoders[0].native is not None:
        return _native_step(decoders, tokens)
    if len(decoders) == 1:
        return decoders[0].step(tokens[:1])[None]
    lead = decoders[0]
    b = len(decoders)
    nh, nkv, hd, groups = lead.n_heads, lead.n_kv, lead.hd, lead.groups
    pos = [d.pos for d in decoders]
    h = F.embedding(tokens, lead.embed_w)  # [B, H]
    cos = torch.stack([d.cos[p] for d, p in zip(decoders, pos)])[:, None]  # [B, 1, hd]
    sin = torch.stack([d.sin[p] for d, p in zip(decoders, pos)])[:, None]
    for i, (w1, e1, q_p, k_p, v_p, o_p, w2, e2, g_p, u_p, d_p) in enumerate(lead.layers):
        x = lead._norm(h, w1, e1)
        q = lead._rope(q_p(x).view(b, nh, hd), cos, sin)  # [B, nh, hd]
        k = lead._rope(k_p(x).view(b, nkv, hd), cos, sin)  # [B, nkv, hd]
        v = v_p(x).view(b, nkv, hd)
        heads = []
        for r, (d, p) in enumerate(zip(decoders, pos)):
            d.k[i, :, p] = k[r]
            d.v[i, :, p] = v[r]
            a = F.scaled_dot_product_attention(q[r].reshape(nkv, groups, hd), d.k[i, :, :p + 1], d.v[i, :, :p + 1],
                                               scale=lead.scale)
            heads.append(a.reshape(1, nh * hd))
        h = h + o_p(torch.cat(heads))
        x = lead._norm(h, w2, e2)
        h = h + d_p(F.silu(g_p(x)) * u_p(x))
    for d in decoders:
        d.pos += 1
    return lead.head(lead._norm(h, lead.norm_w, lead.norm_eps)).float()
