"""The local engine's C kernels, on the CPU: products of float32 rows (one decode step, a batch of them, or a
prompt's tokens) with packed weights, accumulated in float32, and a whole decode step through a Llama/Qwen2 model's
layers.

Why: decoding one token reads every weight once, so on a CPU its time is set by memory traffic, not arithmetic
(SmolLM2-135M: 538 MB of float32 weights per token), and, once that traffic is cut, by the per-operation cost of
running a few hundred tiny tensor operations from Python (on 2 threads torch's SDPA alone took ~1 ms per layer).
Batched rows (concurrent requests, a prompt) then multiply the arithmetic, which float32 FMAs cannot keep up with
(~29 G multiply-adds/s a core on the 2-vCPU machine of ``bench/``).

* Packed weights: each weight is copied once into blocks of 16 rows, so one block is one sequential stream and
  every load of weights feeds 16 outputs. Weights that are *exactly* representable in bfloat16 (a checkpoint
  shipped in bf16 and loaded as float32, or a LoRA base that never changes) are stored in half the bytes with no
  loss, in pairs of inputs (``[blocks, kp / 2, 32]``, k padded to a multiple of 32: the layout of an AMX tile);
  other weights (after a full-weight update) in float32 (``[blocks, k, 16]``). torch's own bf16 kernels cannot be
  used: they round the activations to bf16 as well (a ~1e-3 relative error, far outside the 1e-4 log-prob
  contract).
* Three paths compute the bf16 products, float32 products and sums on each (:func:`isa`): AMX tiles (Intel Sapphire
  Rapids and later, on Linux; ~1,500 G bf16 multiply-adds/s a core here), where each activation is split into three
  bf16 parts whose sum is exactly the float32 value, so every product is exact and only the order of the additions
  differs from a float32 product; AVX-512; portable C. On each path a row's result does not depend on how many
  rows share the call or on the thread that computes it, so a batched request gets bitwise what it gets alone.
  ``REEF_AMX=0`` keeps AVX-512.
* ``reef_decode_layers``: RMSNorm, the projections (with an adapter's LoRA term), rotary embedding, the KV-cache
  write, attention over the cache and the SiLU MLP of every layer for m rows in one call (one token of each of m
  generations, or consecutive tokens of a prompt, which attend causally to the rows before them); the caller keeps
  the embedding, the final norm and the head (:mod:`reef_core.engines.decode`). A layer's products that share an
  input (q, k, v; gate, up) and its attention heads are jobs shared by the kernel's threads.

The source (``kernels_src/reef_kernels.c``, beside this module) is compiled once per machine with the system C
compiler (``cc -O3 -march=native``, cached under ``~/.cache/reef/kernels``, keyed by the source, the CPU model and
the flags) and called through :mod:`ctypes`. Without a compiler,
or on a machine where the build fails, :func:`kernel` and :func:`decode_layers` return None and decoding stays in
torch over float32 weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: The kernels' C source (``kernels_src/reef_kernels.c``, shipped as package data), compiled on first use.
_SOURCE = (resources.files("reef_core.engines") / "kernels_src" / "reef_kernels.c").read_text(encoding="utf-8")

#: Digest of the kernel source: anything laid out for these kernels (packed weights) is tied to it.
SOURCE_DIGEST = hashlib.sha256(_SOURCE.encode()).hexdigest()

_lock = threading.Lock()
_loaded: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def cache_dir() -> Path:
    """Where compiled kernels (and, under ``packed/``, packed weights) are kept: ``$REEF_KERNEL_CACHE`` or
    ``$XDG_CACHE_HOME/reef/kernels`` (``~/.cache/reef/kernels``)."""
    from ..models.loading import user_cache_dir

    return Path(os.environ.get("REEF_KERNEL_CACHE") or user_cache_dir() / "kernels")


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler: decoding keeps float32 weights")
        return None
    flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC"]
    libs = ["-lm"]
    # -march=native: a build is only good for this CPU model (a cache directory shared between hosts, say)
    key = hashlib.sha256((_SOURCE + " ".join(flags) + cc + os.uname().machine + _cpu()).encode()).hexdigest()[:16]
    target = cache_dir() / f"reef_gemv_{key}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "gemv.c"
                src.write_text(_SOURCE)
                out = Path(tmp) / target.name
                subprocess.run([cc, *flags, str(src), "-o", str(out), *libs], check=True, capture_output=True, timeout=120)
                os.replace(out, target)  # atomic: a concurrent builder finds a whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("bf16 decode kernel did not build (%s %s): decoding keeps float32 weights", exc,
                        detail.decode(errors="replace")[:300])
            return None
    lib = ctypes.CDLL(str(target))
    lib.reef_gemv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.reef_gemv.restype = None
    lib.reef_gemv_threads.argtypes = [ctypes.c_int]
    lib.reef_gemv_threads.restype = ctypes.c_int
    lib.reef_decode_layers.argtypes = [ctypes.POINTER(Layer), ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                       ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_float,
                                       ctypes.POINTER(Gen)]
    lib.reef_decode_layers.restype = ctypes.c_int
    lib.reef_bf16_exact.argtypes = [ctypes.c_void_p, ctypes.c_long]
    lib.reef_bf16_exact.restype = ctypes.c_int
    lib.reef_pack.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.reef_pack.restype = None
    lib.reef_amx.argtypes = [ctypes.c_int]
    lib.reef_amx.restype = ctypes.c_int
    lib.reef_isa.argtypes = []
    lib.reef_isa.restype = ctypes.c_int
    lib.reef_amx(int(os.environ.get("REEF_AMX", "1") != "0"))
    return lib


def _cpu() -> str:
    """The CPU's model and feature flags, as Linux reports them ("" elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return "".join(line for line in text.splitlines(keepends=True)
                   if line.startswith(("model name", "flags")))[:4096]


def _lib():
    global _loaded
    with _lock:
        if _loaded is False:
            _loaded = _build() if sys.platform.startswith("linux") or sys.platform == "darwin" else None
        return _loaded or None


def kernel():
    """The C function ``reef_gemv`` (built on first use), or None when it cannot be built here."""
    lib = _lib()
    return lib.reef_gemv if lib else None


def decode_layers():
    """The C function ``reef_decode_layers`` (one decode step through every decoder layer), or None."""
    lib = _lib()
    return lib.reef_decode_layers if lib else None


def isa() -> str | None:
    """What computes the kernel's bf16 products: ``"amx"`` (the CPU's AMX tiles: Intel Sapphire Rapids and later, on
    Linux; ``REEF_AMX=0`` turns them off), ``"avx512"``, ``"c"`` (portable C), or None without the kernel. On every
    path a row's result does not depend on the batch it is in; the paths differ from each other only in the order
    of the float32 additions."""
    lib = _lib()
    return ("c", "avx512", "amx")[lib.reef_isa()] if lib else None


def use_amx(on: bool) -> bool:
    """Turn the AMX path on or off for the process (tests and benchmarks compare the two; never while a product
    runs); returns whether it is on: asking for it where it is unavailable leaves it off."""
    lib = _lib()
    return bool(lib.reef_amx(int(bool(on)))) if lib else False


def set_threads(n: int) -> int:
    """Run the kernel on ``n`` threads (process-wide, like ``torch.set_num_threads``; worker threads are started once
    and never stopped, so this only grows). Returns the count in use; 1 without the kernel."""
    lib = _lib()
    return int(lib.reef_gemv_threads(max(1, int(n)))) if lib else 1


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every element of float32 ``w`` is a bfloat16 value (its low 16 bits are zero)."""
    if w.dtype != torch.float32:
        return False
    w = w.detach().contiguous()
    lib = _lib() if w.device.type == "cpu" else None
    if lib:  # one pass, no temporaries (torch's version takes seconds for SmolLM2's weights on 2 busy cores)
        return bool(lib.reef_bf16_exact(w.data_ptr(), w.numel()))
    return not bool((w.view(torch.int32) & 0xFFFF).any())


def _packed_shape(n: int, k: int, f32: bool) -> tuple[int, int, int]:
    """The kernel's layout of a weight ``[n, k]``: blocks of 16 rows; float32 ``[blocks, k, 16]``, bf16 in pairs of
    inputs with k padded to a multiple of 32, ``[blocks, kp / 2, 32]`` (an AMX tile is 16 such pairs)."""
    blocks = -(-n // 16)
    return (blocks, k, 16) if f32 else (blocks, -(-k // 32) * 16, 32)


class PackedMatrix:
    """A copy of a float32 weight ``[n, k]`` in the kernel's layout (blocks of 16 rows, rows past n zero; see
    :func:`_packed_shape`), stored in bf16 when every element is a bf16 value (half the bytes, no loss) and in float32
    otherwise; multiplied into float32 rows with float32 products and sums."""

    __slots__ = ("w", "n", "k", "f32", "fn", "ptr")

    def __init__(self, w: torch.Tensor, fn):
        self.n, self.k = w.shape
        w = w.detach().contiguous()
        self.f32 = not bf16_exact(w)
        self.w = torch.empty(_packed_shape(self.n, self.k, self.f32),
                             dtype=torch.float32 if self.f32 else torch.bfloat16)
        _lib().reef_pack(w.data_ptr(), self.n, self.k, self.w.data_ptr(), int(self.f32))
        self.fn, self.ptr = fn, self.w.data_ptr()

    @classmethod
    def adopt(cls, packed: torch.Tensor, n: int, k: int, fn) -> "PackedMatrix":
        """A matrix over ``packed``, a copy already in the kernel's layout (bf16 or float32, as :attr:`w` holds it) of
        a weight ``[n, k]``: nothing is checked or reordered but the shape."""
        f32 = packed.dtype == torch.float32
        if packed.dtype not in (torch.bfloat16, torch.float32) or not packed.is_contiguous() \
                or tuple(packed.shape) != _packed_shape(n, k, f32):
            raise ValueError(f"not a packed weight of shape [{n}, {k}]: {packed.dtype} {tuple(packed.shape)}")
        self = cls.__new__(cls)
        self.n, self.k, self.f32 = n, k, f32
        self.w, self.fn, self.ptr = packed, fn, packed.data_ptr()
        return self

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = x @ w.T + bias`` for float32 rows ``x`` ([m, k], contiguous); returns ``out`` ([m, n]). Each row's
        result is bitwise the same whatever m is (a batch equals its rows computed one by one)."""
        self.fn(x.data_ptr(), self.ptr, int(self.f32), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                x.shape[0], self.n, self.k)
        return out


# The C structures of reef_decode_layers (field for field).
class Proj(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("b", ctypes.c_void_p), ("a", ctypes.c_void_p), ("bt", ctypes.c_void_p),
                ("n", ctypes.c_long), ("k", ctypes.c_long), ("r", ctypes.c_long), ("scale", ctypes.c_float),
                ("f32", ctypes.c_int)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("p", Proj * 7)]


class Gen(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("len", ctypes.c_long), ("pos", ctypes.c_long),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]
