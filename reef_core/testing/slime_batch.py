"""A FAKE of slime's training-side data path on one rank (no tensor, pipeline or context parallelism), for CPU tests
and the fake slime driver: what ``reef_slime_hooks`` receives inside a real job.

Mirrors slime's own steps for a ``--debug-train-only`` job: the rollout dump's samples become ``rollout_data``
(``RolloutManager._convert_samples_to_train_data`` then ``tensorize_rollout_data_for_training``), the custom advantage
function fills ``advantages``, a micro-batch holds the per-sample lists plus ``unconcat_tokens`` (``get_batch``),
the model's logits are ``[1, T, V]`` over the micro-batch's sequences packed one after another (slime packs them
with variable-length attention: no sequence sees another, here each is run alone and the logits concatenated), and
the loss reducer is slime's ``get_sum_of_sample_mean`` for one context-parallel rank. With
``--calculate-per-token-loss`` Megatron then divides the summed loss by :func:`step_tokens`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import Tensor, nn


def job_args(rollout_path: str, **overrides: Any) -> SimpleNamespace:
    """The slime ``args`` fields Reef's hooks read."""
    return SimpleNamespace(load_debug_rollout_data=str(rollout_path), rollout_temperature=1.0,
                           calculate_per_token_loss=True, **overrides)


def rollout_data(samples: list[dict]) -> dict[str, Any]:
    """slime's per-rank ``rollout_data`` of the rollout dump's sample dicts (one rank: every sample)."""
    return {
        "tokens": [torch.tensor(s["tokens"], dtype=torch.long) for s in samples],
        "response_lengths": [int(s["response_length"]) for s in samples],
        "total_lengths": [len(s["tokens"]) for s in samples],
        "loss_masks": [torch.tensor(s["loss_mask"], dtype=torch.int) for s in samples],
        "rollout_log_probs": [torch.tensor(s["rollout_log_probs"], dtype=torch.float32) for s in samples],
        "rewards": [float(s["reward"]) for s in samples],
        "sample_indices": [s["index"] for s in samples],
    }


def micro_batch(data: dict[str, Any], rows: list[int] | None = None) -> dict[str, Any]:
    """The loss function's ``batch`` for ``rows`` of ``data`` (all by default)."""
    rows = list(range(len(data["tokens"]))) if rows is None else rows
    batch = {key: [data[key][i] for i in rows] if data.get(key) is not None else None
             for key in ("tokens", "total_lengths", "response_lengths", "loss_masks", "rollout_log_probs",
                         "advantages", "returns")}
    batch["unconcat_tokens"] = batch["tokens"]
    return batch


def packed_logits(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    """``[1, Σ total_lengths, V]`` float32 logits of the micro-batch's sequences, packed."""
    parts = [model(input_ids=t.unsqueeze(0), use_cache=False).logits.float() for t in batch["unconcat_tokens"]]
    return torch.cat(parts, dim=1)


def sum_of_sample_mean(batch: dict[str, Any], per_token: bool = True) -> Callable[[Tensor], Tensor]:
    """slime's reducer on one rank: the masked sum per sample (``per_token``), else divided by its mask's sum."""
    lengths, masks = batch["response_lengths"], batch["loss_masks"]

    def reduce(x: Tensor) -> Tensor:
        parts = []
        for x_i, m in zip(x.split(lengths, dim=0), masks):
            total = (x_i * m).sum()
            parts.append(total if per_token else total / torch.clamp_min(m.sum(), 1))
        return sum(parts)

    return reduce


def step_tokens(data: dict[str, Any]) -> int:
    """Megatron's per-token normaliser of a step: each sample's loss-mask sum, at least 1."""
    return int(sum(max(int(m.sum()), 1) for m in data["loss_masks"]))
