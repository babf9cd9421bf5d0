"""TopK's packed form and TokenData round trips with top-K data."""

from __future__ import annotations

import random

import pytest

from reef_core.engines.base import TokenData
from reef_core.topk import MAX_K, TopK
from reef_core.errors import ValidationFailed


def _top_k(n: int, k: int, vocab: int = 151_000, seed: int = 0) -> TopK:
    rnd = random.Random(seed)
    ids, lps = [], []
    for _ in range(n):
        ids += rnd.sample(range(vocab), k)
        lps += sorted((-rnd.random() * 20 for _ in range(k)), reverse=True)
    return TopK(k=k, ids=ids, logprobs=lps)


def test_pack_round_trip_keeps_ids_exactly_and_logprobs_to_float16():
    top = _top_k(64, 20)
    back = TopK.unpack(top.pack())
    assert back.k == 20 and back.ids == top.ids
    # float16 keeps 11 significant bits: relative error under 2^-11.
    assert all(abs(a - b) <= abs(b) * 2 ** -11 + 1e-7 for a, b in zip(back.logprobs, top.logprobs))


def test_packed_512_by_20_is_compact_even_for_a_large_vocabulary():
    packed = _top_k(512, 20).pack()
    assert len(packed) < 44 * 1024  # vs 10,240 x (4 + 2) = 60 KiB unshuffled, ~250 KB as JSON


def test_extreme_logprobs_and_empty_outputs_pack():
    top = TopK(k=2, ids=[0, 2**31 - 1], logprobs=[0.0, float("-inf")])
    back = TopK.unpack(top.pack())
    assert back.ids == [0, 2**31 - 1] and back.logprobs[0] == 0.0 and back.logprobs[1] == -65504.0
    assert TopK.unpack(TopK(k=3, ids=[], logprobs=[]).pack()).tokens == 0


@pytest.mark.parametrize("data", [b"", b"RTK1", b"XXXX\x01\x00\x00\x00\x01\x00" + b"x" * 8,
                                  TopK(k=1, ids=[1], logprobs=[-1.0]).pack()[:-3]])
def test_unpack_refuses_what_is_not_a_packed_block(data):
    with pytest.raises(ValidationFailed, match="top_k"):
        TopK.unpack(data)


@pytest.mark.parametrize("k, ids, lps", [(0, [], []), (MAX_K + 1, [], []), (2, [1, 2, 3], [0.0, 0.0, 0.0]),
                                         (1, [1], [])])
def test_inconsistent_top_k_is_refused(k, ids, lps):
    with pytest.raises(ValidationFailed):
        TopK(k=k, ids=ids, logprobs=lps)


def test_token_data_round_trips_with_top_k():
    top = _top_k(3, 4, vocab=1000)
    data = TokenData([1, 2], [5, 6, 7], [-0.1, -0.2, -0.3], "v1", top)
    assert "top_k" not in data.to_dict()  # the JSON form stays JSON
    assert TokenData.from_dict(data.to_event()) == data
    packed = dict(data.to_dict(), top_k=top.pack())
    again = TokenData.from_dict(packed)
    assert again.top_k.ids == top.ids and again.output_logprobs == data.output_logprobs
    assert TokenData.from_dict(data.to_dict()).top_k is None  # token data written before top-K still reads


def test_token_data_refuses_top_k_of_another_length():
    with pytest.raises(ValueError, match="covers 3 tokens"):
        TokenData([1], [5, 6], [-0.1, -0.2], None, _top_k(3, 2, vocab=100))
