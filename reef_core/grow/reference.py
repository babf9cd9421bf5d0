"""The frozen reference model: the weights a scenario started from, for objectives that compare against them.

An objective that sets ``needs_reference = True`` receives a :class:`ReferenceModel` in
:meth:`~reef_core.grow.objective.Objective.setup` (``reference=``). It scores the student's tokens under the base
weights, never under a later checkpoint, with no gradient:

* :meth:`ReferenceModel.logprobs` ``(batch)``: over the batch's own prompts (a KL term to the base, as TTT-Discover
  folds into its advantage);
* :meth:`ReferenceModel.logprobs` ``(batch, prompts=...)``: the same output tokens after another prompt per row
  (OpenClaw's hinted teacher), realigned to the student's positions so an objective subtracts them directly;
* :meth:`ReferenceModel.score`: the same forward pass returning, besides those log-probs, the log-probs of given
  candidate tokens per position (``token_ids=batch.top_k_ids``: the teacher's view of the student's top-K set) and
  the base's own top-k tokens (``top_k=k``), as a :class:`ReferenceScores`.

Where the weights come from:

* **LoRA** (:class:`AdapterBaseReference`): the trained ``PeftModel`` itself, inside ``disable_adapter()``. No second
  copy of the weights is held, and the adapter's weights never reach the scores. Before the adapter is attached it
  scores the plain base model it is bound to.
* **Full weights** (:class:`SharedBaseReference`): one frozen copy per process for each base, device and dtype,
  shared by every trainer of the same base through :data:`reference_cache`, loaded on first use (an objective
  that does not ask loads nothing), in eval mode with ``requires_grad_(False)``; training never touches it. The copy
  lives as long as some reference holds it.

Alignment: every result is ``[B, L]`` (``[B, L, K]`` per candidate) like
:func:`~reef_core.grow.objective.sequence_logprobs` and ``TokenBatch.top_k_ids``: position ``t`` holds what the base
says about ``input_ids[b, t]`` given the tokens before it; float32, 0 wherever ``action_mask`` is 0.

Another prompt: the prompt replaced is everything before the row's *first* action token; the rest of the row
(every action token, and the observation tokens between turns of a multi-turn row) follows the new prompt
unchanged, so later turns are scored in the context of the new prompt plus the earlier turns. Rows are
right-padded, as :class:`~reef_core.grow.token_batch.TokenBatch` builds them.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
from torch import Tensor, nn

from reef_core.grow.logprobs import action_logits
from reef_core.grow.token_batch import TokenBatch, TokenDataError


@dataclass
class ReferenceScores:
    """What the base says about a batch's positions (all aligned to the batch, 0 where ``action_mask`` is 0)."""

    #: ``[B, L]`` float32: log-probability of ``input_ids[b, t]`` given the tokens before it.
    logprobs: Tensor
    #: ``[B, L, K]`` float32: log-probabilities of the ``token_ids`` asked for (e.g. the student's top-K set).
    token_logprobs: Tensor | None = None
    #: ``[B, L, k]`` long and float32: the base's own k most likely tokens at each position, highest first.
    top_k_ids: Tensor | None = None
    top_k_logprobs: Tensor | None = None


class ReferenceModel(ABC):
    """Log-probabilities of a batch's tokens under the frozen base weights (see the module docstring)."""

    @abstractmethod
    def _scoring(self) -> Iterator[nn.Module]:
        """A context yielding the module that scores as the base (no adapter, no training)."""

    @property
    def model(self) -> nn.Module:
        """The module the scores come from (for LoRA, the policy: score only through :meth:`score`)."""
        with self._scoring() as module:
            return module

    def logprobs(self, batch: TokenBatch, prompts: Sequence[Sequence[int]] | None = None) -> Tensor:
        """``[B, L]`` base log-probs of ``batch``'s action tokens (0 elsewhere), without gradient.

        ``prompts``: one token-id list per row, replacing the tokens before the row's first action token; the
        row's tokens from there on are scored after it and the result is aligned to ``batch``'s positions."""
        return self.score(batch, prompts).logprobs

    def score(self, batch: TokenBatch, prompts: Sequence[Sequence[int]] | None = None, *,
              token_ids: Tensor | None = None, top_k: int = 0) -> ReferenceScores:
        """One forward pass of the base over ``batch`` (after ``prompts``, as in :meth:`logprobs`), without gradient.

        ``token_ids`` ``[B, L, K]``: also the log-probs of these candidate tokens at each position (a teacher's view
        of the student's top-K set: pass ``batch.top_k_ids``). ``top_k``: also the base's own ``top_k`` most likely
        tokens at each position with their log-probs."""
        shape = tuple(batch.input_ids.shape)
        if token_ids is not None and (token_ids.dim() != 3 or tuple(token_ids.shape[:2]) != shape):
            raise TokenDataError(f"token_ids must be [B, L, K] for a batch of shape {shape}, "
                                 f"got {tuple(token_ids.shape)}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise TokenDataError(f"top_k must be a non-negative integer, got {top_k!r}")
        with torch.no_grad(), self._scoring() as module:
            if prompts is None:
                scores = _score(module, batch, token_ids, top_k)
            else:
                scores = _score_after(module, batch, prompts, token_ids, top_k)
        mask = batch.action_mask.to(scores.logprobs.device) > 0
        return ReferenceScores(**{name: _masked(getattr(scores, name), mask) for name in
                                  ("logprobs", "token_logprobs", "top_k_ids", "top_k_logprobs")})


def _masked(value: Tensor | None, mask: Tensor) -> Tensor | None:
    if value is None:
        return None
    keep = mask if value.dim() == 2 else mask.unsqueeze(-1)
    return torch.where(keep, value, torch.zeros_like(value))


def _score(module: nn.Module, batch: TokenBatch, token_ids: Tensor | None, top_k: int) -> ReferenceScores:
    """Scores at ``batch``'s own positions (before masking); log-probs exactly as ``sequence_logprobs`` computes."""
    first, logits = action_logits(module, batch)
    logits = logits.float()
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)

    def placed(values: Tensor) -> Tensor:  # [B, L - first, ...] -> [B, L, ...], 0 before ``first``
        out = values.new_zeros((batch.size, batch.seq_len, *values.shape[2:]))
        out[:, first:] = values
        return out

    ids = batch.input_ids[:, first:].unsqueeze(-1)
    scores = ReferenceScores(logprobs=placed((logits.gather(-1, ids) - norm).squeeze(-1)))
    if token_ids is not None:
        scores.token_logprobs = placed(logits.gather(-1, token_ids[:, first:].long().to(logits.device)) - norm)
    if top_k:
        values, indices = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
        scores.top_k_ids, scores.top_k_logprobs = placed(indices), placed(values - norm)
    return scores


def _first_actions(batch: TokenBatch) -> list[int | None]:
    """Per row, the index of its first action token (None for a row without one)."""
    firsts: list[int | None] = []
    for row in batch.action_mask > 0:
        cols = torch.nonzero(row)
        firsts.append(int(cols[0]) if cols.numel() else None)
    return firsts


def _score_after(module: nn.Module, batch: TokenBatch, prompts: Sequence[Sequence[int]],
                 token_ids: Tensor | None, top_k: int) -> ReferenceScores:
    """Score each row's tokens from its first action on after ``prompts[b]``; realign to ``batch``."""
    if len(prompts) != batch.size:
        raise TokenDataError(f"{len(prompts)} prompts for a batch of {batch.size} rows")
    if batch.size and not bool((batch.attention_mask[:, 0] > 0).all()):
        raise TokenDataError("reference scoring with other prompts needs right-padded rows (as TokenBatch builds)")
    lengths = [int(n) for n in batch.attention_mask.sum(dim=1)]
    firsts = _first_actions(batch)
    # (row, start in batch, start in the moved row, tokens) of every row's span from its first action token
    spans: list[tuple[int, int, int, int]] = []
    seqs: list[list[int]] = []
    for b, (prompt, first) in enumerate(zip(prompts, firsts)):
        ids = [int(x) for x in prompt]
        if not ids:
            raise TokenDataError(f"prompt {b} is empty: the first output token needs a context")
        tail = batch.input_ids[b, first:lengths[b]].tolist() if first is not None else []
        seqs.append(ids + tail)
        if first is not None:
            spans.append((b, first, len(ids), len(tail)))
    width = max(len(s) for s in seqs)
    device = batch.device
    ids = torch.zeros((batch.size, width), dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    action = torch.zeros((batch.size, width), dtype=torch.float32, device=device)
    moved_ids = None if token_ids is None else token_ids.new_zeros((batch.size, width, token_ids.shape[-1]))
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.long, device=device)
        attn[b, :len(seq)] = 1
    for b, old, new, n in spans:
        action[b, new:new + n] = batch.action_mask[b, old:old + n]
        if moved_ids is not None:
            moved_ids[b, new:new + n] = token_ids[b, old:old + n]
    zeros = torch.zeros(batch.size, dtype=torch.long, device=device)
    moved = TokenBatch(input_ids=ids, attention_mask=attn, action_mask=action,
                       rollout_logprobs=torch.zeros_like(action), rewards=torch.zeros(batch.size, device=device),
                       response_starts=zeros, response_lengths=zeros)
    scored = _score(module, moved, moved_ids, top_k)

    def back(value: Tensor | None) -> Tensor | None:
        if value is None:
            return None
        out = value.new_zeros((batch.size, batch.seq_len, *value.shape[2:]))
        for b, old, new, n in spans:
            out[b, old:old + n] = value[b, new:new + n]
        return out

    return ReferenceScores(logprobs=back(scored.logprobs), token_logprobs=back(scored.token_logprobs),
                           top_k_ids=back(scored.top_k_ids), top_k_logprobs=back(scored.top_k_logprobs))


# --------------------------------------------------------------------------------------------------- LoRA


class AdapterBaseReference(ReferenceModel):
    """The base under a LoRA policy: the bound model with its adapters disabled (no second copy of the weights).

    Bound to the plain model before the adapter is attached, then (:meth:`bind`) to the ``PeftModel``."""

    def __init__(self, model: nn.Module):
        self._model = model

    def bind(self, model: nn.Module) -> None:
        """Score with ``model`` from now on (the trainer's policy once the adapter is attached)."""
        self._model = model

    @contextmanager
    def _scoring(self) -> Iterator[nn.Module]:
        model = self._model
        disable = getattr(model, "disable_adapter", None)
        with disable() if callable(disable) else nullcontext():
            yield model


# --------------------------------------------------------------------------------------------------- full weights


class ReferenceCache:
    """One frozen copy of each base per process, keyed by the base's identity, device and dtype.

    Entries are held weakly: a copy lives while some :class:`SharedBaseReference` uses it."""

    def __init__(self) -> None:
        self._models: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, key: Hashable, load: Callable[[], tuple[Any, Any]], device: torch.device | str,
            dtype: torch.dtype | None = None) -> nn.Module:
        """The frozen model of ``key`` on ``device`` (``dtype``: as loaded when None), loading it with ``load()``
        (``() -> (model, tokenizer)``) the first time."""
        full_key = (key, str(torch.device(device)), str(dtype) if dtype is not None else None)
        with self._lock:  # loads are rare: one lock keeps two trainers of one base from loading it twice
            model = self._models.get(full_key)
            if model is None:
                model = load()[0]
                model.to(device=device, dtype=dtype)
                model.eval()
                model.requires_grad_(False)
                self._models[full_key] = model
            return model

    def __len__(self) -> int:
        return len(self._models)

    def keys(self) -> list:
        return list(self._models.keys())


#: The process-wide cache of full-weight references.
reference_cache = ReferenceCache()


class SharedBaseReference(ReferenceModel):
    """A frozen full copy of the base from :data:`reference_cache`, loaded on first use."""

    def __init__(self, key: Hashable, load: Callable[[], tuple[Any, Any]], device: torch.device | str,
                 dtype: torch.dtype | None = None, cache: ReferenceCache | None = None):
        self._args = (key, load, torch.device(device), dtype)
        self._cache = cache if cache is not None else reference_cache
        self._model: nn.Module | None = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @contextmanager
    def _scoring(self) -> Iterator[nn.Module]:
        if self._model is None:
            self._model = self._cache.get(*self._args)
        yield self._model
