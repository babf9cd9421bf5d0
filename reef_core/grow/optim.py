"""The AdamW every weight trainer steps with: torch's fused kernel wherever the parameters allow it.

torch's default ``AdamW`` on CPU runs one tensor at a time, about seven elementwise passes over every parameter
(``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``add_``, ``addcdiv_``...): on a full-weight 135 M-parameter critic
that was 1.5-4 s of a SAO step on 2 cores. The fused kernel (``fused=True``, CPU and CUDA since torch 2.4) makes
one pass, 10-30x faster, with the same update rule (results agree to float rounding, ~1 ulp). Parameters it does
not support (another device, a dtype without a fused kernel) get the default implementation.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

#: dtypes the fused AdamW kernel takes
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_supported(params: list[Tensor]) -> bool:
    """Whether torch's fused AdamW can step ``params`` (floating, one device of a kind it supports)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = _get_fused_kernels_supported_devices()
    except ImportError:  # a private helper: fall back to the devices every recent torch has the kernel for
        devices = ["cpu", "cuda"]
    if not params:
        return False
    kinds = {p.device.type for p in params}
    return (len(kinds) == 1 and kinds.pop() in devices
            and all(p.dtype in _FUSED_DTYPES for p in params))


def adamw(params: Iterable[Tensor], **options) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **options)``, fused when :func:`fused_supported` (see the module docstring)."""
    params = list(params)
    if "fused" not in options and "foreach" not in options and fused_supported(params):
        try:
            return torch.optim.AdamW(params, fused=True, **options)
        except (RuntimeError, ValueError):  # a torch build without the kernel for this device
            pass
    return torch.optim.AdamW(params, **options)


def clipped_step(optimizer: torch.optim.Optimizer, params: list[Tensor], max_norm: float | None, *,
                 step_nonfinite: bool = False) -> float:
    """Clip the global gradient norm of ``params`` to ``max_norm`` (``None``: no clipping) and step ``optimizer``
    once, as ``clip_grad_norm_`` then ``step()`` would; returns the norm before clipping.

    ``clip_grad_norm_`` rescales every gradient in a pass of its own, even by a factor of 1. Here a factor of 1
    touches nothing (exact), and a fused AdamW takes the factor into its own pass (``grad_scale``, the hook torch's
    ``GradScaler`` uses: the kernel divides each gradient by ``1 / factor``, equal to the multiplication up to an
    ulp). A non-finite norm steps nothing, unless ``step_nonfinite`` (then as ``clip_grad_norm_`` + ``step()``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    norm = float(total)
    limit = float("inf") if max_norm is None else float(max_norm)
    if not math.isfinite(norm):
        if step_nonfinite:
            torch.nn.utils.clip_grads_with_norm_(params, limit, total)
            optimizer.step()
        return norm
    coef = limit / (total + 1e-6)  # clip_grad_norm_'s factor, in the norm's dtype
    if float(coef) >= 1.0:
        optimizer.step()
    elif optimizer.defaults.get("fused"):
        optimizer.grad_scale = coef.reciprocal()  # read by the fused step, then dropped
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
    else:
        torch.nn.utils.clip_grads_with_norm_(params, limit, total)
        optimizer.step()
    return norm
