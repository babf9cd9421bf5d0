"""Entropic adaptive-β leave-one-out advantages against the golden vectors (recipes reference §12.1)."""

from __future__ import annotations

import math

import pytest
import torch

from reef_core.api import ENTROPIC_TARGET_KL as TARGET_KL
from reef_core.api import entropic_beta as solve_beta
from reef_core.api import entropic_kl as _kl_to_uniform
from reef_ttt.advantages import group_advantages


@pytest.mark.parametrize("rewards, beta, expected", [
    ([0, 0, 0, 1], 2.55324, [-0.797963, -0.797963, -0.797963, 11.848733]),
    ([1, 0, 0, 0, 0, 0, 0, 0], 2.46539, [10.768051] + [-0.606034] * 7),
    ([0.1, 0.2, 0.3, 0.4], 14.4586, [-0.969633, -0.866698, -0.338701, 8.865418]),
])
def test_golden_vectors(rewards, beta, expected):
    adv, solved = group_advantages(rewards)
    assert solved == pytest.approx(beta, rel=1e-4)
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)
    delta = torch.tensor(rewards, dtype=torch.float32) - max(rewards)
    assert _kl_to_uniform(delta, solved) == pytest.approx(TARGET_KL, abs=1e-6)


def test_shift_and_scale_invariance():
    adv, beta = group_advantages([2.60, 2.61, 2.62, 2.63])
    assert beta == pytest.approx(144.584, rel=1e-4)
    assert adv.tolist() == pytest.approx([-0.969633, -0.866698, -0.338701, 8.865418], rel=1e-4, abs=1e-4)
    a, _ = group_advantages([3.0, 1.0, 2.0, 5.0])
    b, _ = group_advantages([7 * 3.0 - 4, 7 * 1.0 - 4, 7 * 2.0 - 4, 7 * 5.0 - 4])
    assert a.tolist() == pytest.approx(b.tolist(), rel=1e-4, abs=1e-5)


def test_edge_cases():
    adv, _ = group_advantages([1, 1, 0, 0])
    assert adv.tolist() == pytest.approx([2, 2, -1, -1], abs=1e-4)
    adv, beta = group_advantages([0.5] * 6)
    assert beta == 1048576.0 and adv.abs().max() == 0
    adv, beta = group_advantages([0.3])
    assert beta == 0.0 and adv.tolist() == [0.0]
    assert solve_beta([0.0, 1.0]) > 0 and group_advantages([0, 1])[0][1] > 1e9  # R = 2 is degenerate


def test_other_estimators():
    adv, beta = group_advantages([0.0, 1.0, 2.0], "mean_baseline")
    assert adv.tolist() == pytest.approx([-1, 0, 1]) and beta == 0.0
    adv, beta = group_advantages([0.0, 1.0], "entropic")
    assert beta == 2.0 and adv[1] == pytest.approx(math.exp(2.0) - 1, rel=1e-5)
    with pytest.raises(ValueError):
        group_advantages([1, 2], "nope")
