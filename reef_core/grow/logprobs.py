"""Log-probabilities of a batch's tokens under a model: what objectives and the frozen reference both compute.

Kept apart from :mod:`reef_core.grow.objective` (which re-exports both names) so the reference model can use
them without importing the objective contract that names it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from reef_core.grow.losses import gather_logprobs
from reef_core.grow.token_batch import TokenBatch


def _base_forward_params(model: nn.Module) -> set[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def action_logits(model: nn.Module, batch: TokenBatch) -> tuple[int, Tensor]:
    """``(first, logits)``: the model's next-token logits ``[B, L - first, V]`` where ``logits[:, j]`` scores the token
    at position ``first + j`` (it is read at ``first + j - 1``); ``first`` is the batch's first action column (>= 1).

    Only those positions are computed (``logits_to_keep``), so a long prompt costs no vocabulary-sized logits."""
    length = batch.seq_len
    cols = torch.nonzero(batch.action_mask.sum(dim=0) > 0)
    first = int(cols[0]) if cols.numel() else length - 1
    first = max(first, 1)
    keep = length - first + 1  # logits at positions first-1 .. L-1
    kwargs: dict[str, Any] = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    if "logits_to_keep" in _base_forward_params(model):
        kwargs["logits_to_keep"] = keep
    logits = model(**kwargs).logits
    logits = logits[:, -keep:]  # (a model without logits_to_keep returned every position)
    return first, logits[:, :-1]  # the last position scores no token of the batch


def sequence_logprobs(model: nn.Module, batch: TokenBatch) -> Tensor:
    """``[B, L]`` log-probability the model gives each token of ``batch.input_ids`` given the tokens before it.

    Full-vocabulary ``log_softmax`` at temperature 1 (the distribution the local engine records), float32.
    Only positions from the first action token on are computed (:func:`action_logits`); earlier positions are 0.
    """
    ids = batch.input_ids
    first, logits = action_logits(model, batch)
    picked = gather_logprobs(logits, ids[:, first:])  # logits at t-1 score the token at t
    out = torch.zeros(ids.shape, dtype=picked.dtype, device=picked.device)
    out[:, first:] = picked
    return out
