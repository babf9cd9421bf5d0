"""Token-level training batches: padded tensors built from processor samples.

A :class:`TokenBatch` holds, for ``B`` samples padded on the right to length ``L``:

* ``input_ids`` ``[B, L]`` and ``attention_mask`` ``[B, L]``: the token sequence the policy is scored on;
* ``action_mask`` ``[B, L]`` (float, 1 = a token the model generated, 0 = prompt, observation or padding);
* ``rollout_logprobs`` ``[B, L]``: the engine's log-probability of each action token, captured at generation time
  (0 elsewhere);
* ``rewards`` ``[B]``, ``response_starts`` ``[B]`` (index of the first response token) and ``response_lengths``
  ``[B]`` (the whole response span, observation tokens included, as SAO's length-adaptive λ wants);
* ``group_keys``, ``versions`` (per sample, the version of every turn) and ``sample_ids``;
* ``extras``: per-row tensors an objective attaches (advantages...), sliced with the batch;
* ``top_k_ids`` ``[B, L, K]`` (long), ``top_k_logprobs`` ``[B, L, K]`` and ``top_k_mask`` ``[B, L]`` when the engine
  captured top-K log-probs (``engine.top_k_logprobs``) for some action token, else ``None``: at position ``t`` the K
  most likely next tokens given ``input_ids[b, :t]`` and their log-probs at temperature 1, highest first, where
  ``top_k_mask`` is 1 (0 ids and log-probs elsewhere). Rows captured with different K are cut to the smallest.

All per-token tensors are aligned to *token positions*: ``rollout_logprobs[b, t]`` is the log-probability of
``input_ids[b, t]`` given ``input_ids[b, :t]``. Position 0 is never an action (a prompt has at least one token).

Single turn: the sequence is ``prompt_ids + output_ids`` of the turn. Multi-turn: the sequence is the *last* turn's
``prompt_ids + output_ids``; an earlier turn's output counts as action tokens where the final sequence holds that
turn's prompt as a prefix and its output right after it (the log-probs were computed in exactly that context). When
the re-rendered history diverges from what was sampled, the matching prefix of the output is kept as action and the
rest is treated as observation; a turn whose prompt is not a prefix is entirely observation. ``stats`` counts both.

Log-probs are never rebuilt from text: a sample without token data or log-probs raises :class:`TokenDataError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from reef_core.topk import TopK
from reef_core.errors import ValidationFailed


class TokenDataError(ValidationFailed):
    """A sample cannot become a token-level training row (no token data, no log-probs, inconsistent lengths)."""

    code = "missing_token_data"


@dataclass
class TokenRow:
    """One sample before padding (plain Python lists, aligned to ``input_ids``)."""

    input_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    response_start: int
    group_key: str | None = None
    versions: list[str | None] = field(default_factory=list)
    sample_id: str | None = None
    turns: int = 1
    turns_matched: int = 1
    turns_partial: int = 0
    turns_unmatched: int = 0
    #: position -> (top-K ids, their log-probs) for action tokens whose turn carried top-K data
    top_k: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.action_mask) != n or len(self.rollout_logprobs) != n:
            raise TokenDataError("input_ids, action_mask and rollout_logprobs must have the same length")
        if n and self.action_mask[0]:
            raise TokenDataError("the first token cannot be an action: nothing precedes it")
        if not 0 <= self.response_start <= n:
            raise TokenDataError(f"response_start {self.response_start} outside the sequence of {n} tokens")


def _describe(sample: Any) -> str:
    ident = getattr(sample, "report_id", None) or (list(getattr(sample, "source_ids", []) or []) or [None])[0]
    return f"sample {ident!r}" if ident else "sample"


def _turn_tokens(sample: Any, index: int, tokens: Any) -> tuple[list[int], list[int], list[float], TopK | None]:
    """Validated ``(prompt_ids, output_ids, output_logprobs, top_k)`` of one turn."""
    where = f"{_describe(sample)}, turn {index}"
    if not isinstance(tokens, dict):
        raise TokenDataError(
            f"{where} has no token data: the engine did not capture token ids and log-probs, and they are never "
            "rebuilt from text (serve the scenario with an engine that records tokens, e.g. engine.kind=local)")
    prompt, output, logprobs = tokens.get("prompt_ids"), tokens.get("output_ids"), tokens.get("output_logprobs")
    if not isinstance(prompt, list) or not isinstance(output, list):
        raise TokenDataError(f"{where}: token data lacks prompt_ids or output_ids")
    if not isinstance(logprobs, list):
        raise TokenDataError(f"{where} has no rollout log-probs; an importance ratio needs the engine's own "
                             "log-probs and they are never recomputed")
    if len(logprobs) != len(output):
        raise TokenDataError(f"{where}: {len(logprobs)} log-probs for {len(output)} output tokens")
    if not prompt:
        raise TokenDataError(f"{where}: empty prompt_ids (the first output token has no context)")
    try:
        lps = [float(x) for x in logprobs]
    except (TypeError, ValueError) as exc:
        raise TokenDataError(f"{where}: log-probs must be numbers") from exc
    if not all(math.isfinite(x) and x <= 1e-6 for x in lps):
        raise TokenDataError(f"{where}: log-probs must be finite and <= 0")
    try:
        top_k = TopK.coerce(tokens.get("top_k"))
    except ValidationFailed as exc:
        raise TokenDataError(f"{where}: {exc}") from exc
    if top_k is not None and top_k.tokens != len(output):
        raise TokenDataError(f"{where}: top-K log-probs for {top_k.tokens} of {len(output)} output tokens")
    return [int(x) for x in prompt], [int(x) for x in output], lps, top_k


def row_from_sample(sample: Any) -> TokenRow:
    """The :class:`TokenRow` of a processor :class:`~reef_core.observe.processor.Sample` (see the module docstring).

    Raises :class:`TokenDataError` for a sample without a finite reward, without token data on any turn, without
    log-probs, or whose last turn produced no token.
    """
    reward = getattr(sample, "reward", None)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TokenDataError(f"{_describe(sample)} has no finite reward")
    segments = list(getattr(sample, "segments", []) or [])
    if not segments:
        raise TokenDataError(f"{_describe(sample)} has no assistant turn")
    turns = [_turn_tokens(sample, i, seg.tokens) for i, seg in enumerate(segments)]
    last_prompt, last_output, last_lps, last_top = turns[-1]
    if not last_output:
        raise TokenDataError(f"{_describe(sample)}: the last turn generated no token")
    seq = last_prompt + last_output
    n = len(seq)
    action = [0] * n
    logps = [0.0] * n
    start_last = len(last_prompt)
    top_k: dict[int, tuple[list[int], list[float]]] = {}
    for j, lp in enumerate(last_lps):
        action[start_last + j] = 1
        logps[start_last + j] = lp
        if last_top is not None:
            top_k[start_last + j] = last_top.row(j)
    matched, partial, unmatched = 1, 0, 0
    response_start = start_last
    for prompt, output, lps, top in turns[:-1]:
        p = len(prompt)
        if p > start_last or seq[:p] != prompt:
            unmatched += 1  # the client rewrote its history: the turn's tokens are not in this sequence
            continue
        response_start = min(response_start, p)  # the response span starts at the first turn found in place
        m = 0
        limit = min(len(output), start_last - p)  # never overlap the last turn's own output
        while m < limit and seq[p + m] == output[m]:
            action[p + m] = 1
            logps[p + m] = lps[m]
            if top is not None:
                top_k[p + m] = top.row(m)
            m += 1
        if m == len(output):
            matched += 1
        elif m > 0:
            partial += 1
        else:
            unmatched += 1
    group_key = getattr(sample, "group_key", None)
    return TokenRow(
        input_ids=seq, action_mask=action, rollout_logprobs=logps, reward=float(reward),
        response_start=response_start, group_key=group_key, versions=list(getattr(sample, "versions", []) or []),
        sample_id=getattr(sample, "report_id", None), turns=len(turns), turns_matched=matched,
        turns_partial=partial, turns_unmatched=unmatched, top_k=top_k,
    )


def row_from_tokens(prompt_ids: Sequence[int], output_ids: Sequence[int], output_logprobs: Sequence[float],
                    reward: float, *, group_key: str | None = None, version: str | None = None,
                    sample_id: str | None = None) -> TokenRow:
    """A single-turn row straight from token lists (tests, offline data)."""
    if len(output_logprobs) != len(output_ids):
        raise TokenDataError(f"{len(output_logprobs)} log-probs for {len(output_ids)} output tokens")
    if not prompt_ids:
        raise TokenDataError("empty prompt_ids")
    p = len(prompt_ids)
    return TokenRow(
        input_ids=[int(x) for x in prompt_ids] + [int(x) for x in output_ids],
        action_mask=[0] * p + [1] * len(output_ids),
        rollout_logprobs=[0.0] * p + [float(x) for x in output_logprobs],
        reward=float(reward), response_start=p, group_key=group_key, versions=[version], sample_id=sample_id,
    )


@dataclass
class TokenBatch:
    """Padded token tensors of a batch (see the module docstring)."""

    input_ids: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    rollout_logprobs: Tensor
    rewards: Tensor
    response_starts: Tensor
    response_lengths: Tensor
    group_keys: list[str | None] = field(default_factory=list)
    versions: list[list[str | None]] = field(default_factory=list)
    sample_ids: list[str | None] = field(default_factory=list)
    #: Per-row tensors attached by an objective (first dimension = batch size), sliced by :meth:`split`.
    extras: dict[str, Tensor] = field(default_factory=dict)
    #: Action tokens and samples of the WHOLE batch: micro-batches keep them, so per-micro-batch losses normalised
    #: by them add up to the full-batch loss (gradient accumulation is then exact).
    norm_tokens: int = 0
    norm_samples: int = 0
    #: Counters about how the rows were built (turns matched/partial/unmatched, observation tokens...).
    stats: dict[str, float] = field(default_factory=dict)
    #: Top-K log-probs captured at generation (see the module docstring); ``None`` when no row has any.
    top_k_ids: Tensor | None = None
    top_k_logprobs: Tensor | None = None
    top_k_mask: Tensor | None = None

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_samples(cls, samples: Iterable[Any], pad_token_id: int = 0) -> "TokenBatch":
        """Build from processor samples (raises :class:`TokenDataError` on a sample that cannot train)."""
        return cls.from_rows([row_from_sample(s) for s in samples], pad_token_id=pad_token_id)

    @classmethod
    def from_rows(cls, rows: Sequence[TokenRow], pad_token_id: int = 0) -> "TokenBatch":
        """Right-pad ``rows`` into tensors."""
        if not rows:
            raise TokenDataError("an empty batch has nothing to train on")
        b, length = len(rows), max(len(r.input_ids) for r in rows)
        ids = torch.full((b, length), int(pad_token_id), dtype=torch.long)
        attn = torch.zeros((b, length), dtype=torch.long)
        action = torch.zeros((b, length), dtype=torch.float32)
        logps = torch.zeros((b, length), dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(r.input_ids)
            ids[i, :n] = torch.tensor(r.input_ids, dtype=torch.long)
            attn[i, :n] = 1
            action[i, :n] = torch.tensor(r.action_mask, dtype=torch.float32)
            logps[i, :n] = torch.tensor(r.rollout_logprobs, dtype=torch.float32)
        top = _top_k_tensors(rows, length)
        starts = torch.tensor([r.response_start for r in rows], dtype=torch.long)
        lengths = torch.tensor([len(r.input_ids) - r.response_start for r in rows], dtype=torch.long)
        action_tokens = int(action.sum())
        response_tokens = int(lengths.sum())
        stats = {
            "samples": float(b),
            "turns": float(sum(r.turns for r in rows)),
            "turns_matched": float(sum(r.turns_matched for r in rows)),
            "turns_partial": float(sum(r.turns_partial for r in rows)),
            "turns_unmatched": float(sum(r.turns_unmatched for r in rows)),
            "action_tokens": float(action_tokens),
            "response_tokens": float(response_tokens),
            "observation_tokens": float(response_tokens - action_tokens),
        }
        return cls(
            input_ids=ids, attention_mask=attn, action_mask=action, rollout_logprobs=logps,
            rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32), response_starts=starts,
            response_lengths=lengths, group_keys=[r.group_key for r in rows], versions=[list(r.versions) for r in rows],
            sample_ids=[r.sample_id for r in rows], norm_tokens=action_tokens, norm_samples=b, stats=stats, **top,
        )

    # -- shape and movement ------------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def __len__(self) -> int:
        return self.size

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    _TENSORS = ("input_ids", "attention_mask", "action_mask", "rollout_logprobs", "rewards", "response_starts",
                "response_lengths")
    _OPTIONAL = ("top_k_ids", "top_k_logprobs", "top_k_mask")

    def to(self, device: torch.device | str) -> "TokenBatch":
        moved = {name: getattr(self, name).to(device) for name in self._TENSORS}
        moved.update({name: getattr(self, name).to(device) for name in self._OPTIONAL
                      if getattr(self, name) is not None})
        return replace(self, **moved, extras={k: v.to(device) for k, v in self.extras.items()})

    def with_extras(self, **tensors: Tensor) -> "TokenBatch":
        """A copy with per-row tensors attached (each with first dimension = batch size)."""
        for name, value in tensors.items():
            if value.shape[0] != self.size:
                raise ValueError(f"extra {name!r} has first dimension {value.shape[0]}, batch has {self.size} rows")
        return replace(self, extras={**self.extras, **tensors})

    def select(self, index: Sequence[int] | slice) -> "TokenBatch":
        """Rows ``index`` as a batch; the normalisers of the whole batch are kept. Padding columns that every
        selected row leaves empty are trimmed."""
        idx = list(range(self.size))[index] if isinstance(index, slice) else list(index)
        t = torch.tensor(idx, dtype=torch.long, device=self.device)
        width = int(self.attention_mask[t].sum(dim=1).max()) if idx else 0
        parts = {}
        for name in self._TENSORS:
            value = getattr(self, name)[t]
            parts[name] = value[:, :width] if value.dim() == 2 else value
        for name in self._OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                parts[name] = value[t][:, :width]
        extras = {}
        for name, value in self.extras.items():
            value = value[t]
            extras[name] = value[:, :width] if value.dim() >= 2 and value.shape[1] == self.seq_len else value
        return replace(self, **parts, extras=extras, group_keys=[self.group_keys[i] for i in idx],
                       versions=[self.versions[i] for i in idx], sample_ids=[self.sample_ids[i] for i in idx])

    def split(self, parts: int) -> list["TokenBatch"]:
        """``parts`` contiguous micro-batches of (nearly) equal size, at most one per row."""
        parts = max(1, min(int(parts), self.size))
        bounds = [round(i * self.size / parts) for i in range(parts + 1)]
        return [self.select(slice(bounds[i], bounds[i + 1])) for i in range(parts)]


def _top_k_tensors(rows: Sequence[TokenRow], length: int) -> dict[str, Tensor]:
    """``top_k_ids``, ``top_k_logprobs`` and ``top_k_mask`` of padded rows (empty when no row has top-K data)."""
    if not any(r.top_k for r in rows):
        return {}
    k = min(len(ids) for r in rows for ids, _ in r.top_k.values())
    ids = torch.zeros((len(rows), length, k), dtype=torch.long)
    logps = torch.zeros((len(rows), length, k), dtype=torch.float32)
    mask = torch.zeros((len(rows), length), dtype=torch.float32)
    for i, r in enumerate(rows):
        if not r.top_k:
            continue
        positions = sorted(r.top_k)
        pos = torch.tensor(positions, dtype=torch.long)
        ids[i, pos] = torch.tensor([r.top_k[t][0][:k] for t in positions], dtype=torch.long)
        logps[i, pos] = torch.tensor([r.top_k[t][1][:k] for t in positions], dtype=torch.float32)
        mask[i, pos] = 1.0
    return {"top_k_ids": ids, "top_k_logprobs": logps, "top_k_mask": mask}
