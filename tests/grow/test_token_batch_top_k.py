"""Top-K log-probs in TokenBatch: aligned to token positions, masked, sliced and moved with the batch."""

from __future__ import annotations

import pytest
import torch

from reef_core.topk import TopK
from reef_core.grow.token_batch import TokenBatch, TokenDataError, row_from_sample
from reef_core.observe.processor import Sample, Segment


def _top(output: list[int], k: int, base: float = -1.0) -> TopK:
    """Top-K whose first candidate is the output token, the rest ids 100+..., log-probs base, base-1, ..."""
    ids, lps = [], []
    for t, tid in enumerate(output):
        ids += [tid] + [100 + t * k + j for j in range(1, k)]
        lps += [base - j - t / 10 for j in range(k)]
    return TopK(k=k, ids=ids, logprobs=lps)


def _tokens(prompt, output, top=None):
    tokens = {"prompt_ids": prompt, "output_ids": output, "output_logprobs": [-0.5] * len(output), "version": "v"}
    if top is not None:
        tokens["top_k"] = top
    return tokens


def _sample(*segments, reward=1.0, rid="rep"):
    messages = []
    for _ in segments:
        messages += [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    return Sample(scenario="s", messages=messages, reward=reward, report_id=rid,
                  segments=[Segment(2 * i + 1, f"r{i}", "v", tokens=t) for i, t in enumerate(segments)])


def test_top_k_lands_on_the_action_positions_of_every_turn():
    first = _top([5, 6], 3)
    last = _top([8, 9, 10], 3, base=-2.0)
    sample = _sample(_tokens([1, 2], [5, 6], first), _tokens([1, 2, 5, 6, 7], [8, 9, 10], last))
    batch = TokenBatch.from_samples([sample, _sample(_tokens([1], [4]), rid="plain")])
    assert batch.top_k_ids.shape == (2, 8, 3) and batch.top_k_logprobs.shape == (2, 8, 3)
    assert batch.top_k_mask[0].tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    assert batch.top_k_mask[1].sum() == 0  # a sample without top-K data: masked out, not invented
    assert batch.top_k_ids[0, 2].tolist() == first.row(0)[0] and batch.top_k_ids[0, 7].tolist() == last.row(2)[0]
    assert torch.allclose(batch.top_k_logprobs[0, 5], torch.tensor(last.row(0)[1]))
    # The first candidate is the token at that position: ids are aligned like rollout_logprobs.
    on = batch.top_k_mask[0] > 0
    assert torch.equal(batch.top_k_ids[0, on, 0], batch.input_ids[0, on])
    assert torch.equal(on.float(), batch.action_mask[0])


def test_different_k_is_cut_to_the_smallest_and_slicing_keeps_alignment():
    a = _sample(_tokens([1, 2, 3], [4, 5], _top([4, 5], 5)), rid="a")
    b = _sample(_tokens([1], [7], _top([7], 2)), rid="b")
    batch = TokenBatch.from_samples([b, a])
    assert batch.top_k_ids.shape[-1] == 2
    part = batch.select([1])
    assert part.top_k_ids.shape == (1, 5, 2) and part.top_k_mask[0].tolist() == [0, 0, 0, 1, 1]
    assert part.top_k_ids[0, 3].tolist() == [4, 101]
    assert [p.top_k_mask.shape[0] for p in batch.split(2)] == [1, 1]
    moved = batch.to("cpu")
    assert moved.top_k_logprobs is not None


def test_batches_without_top_k_have_none():
    batch = TokenBatch.from_samples([_sample(_tokens([1, 2], [3, 4]))])
    assert batch.top_k_ids is None and batch.top_k_logprobs is None and batch.top_k_mask is None
    assert batch.select([0]).top_k_ids is None and batch.to("cpu").top_k_mask is None


def test_packed_top_k_of_a_record_is_accepted_and_a_mismatched_one_refused():
    top = _top([3, 4], 2)
    row = row_from_sample(_sample(_tokens([1, 2], [3, 4], top.pack())))
    assert row.top_k[2][0] == [3, 100 + 1]
    with pytest.raises(TokenDataError, match="top-K log-probs for 1 of 2"):
        row_from_sample(_sample(_tokens([1, 2], [3, 4], _top([3], 2))))
