"""The circle-packing verifier, seeds and CPU executor."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from reef_ttt.tasks import circle_packing as cp


def _grid_plus_gap(extra: float = 0.0) -> list[list[float]]:
    circles = [[0.1 + 0.2 * i, 0.1 + 0.2 * j, 0.1] for j in range(5) for i in range(5)]
    circles.append([0.2, 0.2, math.sqrt(2) * 0.1 - 0.1 + extra])
    return circles


def test_grid_plus_gap_scores_the_reference_value():
    assert cp.verify(_grid_plus_gap(), n=26) == pytest.approx(2.541421, abs=1e-6)
    assert cp.check(_grid_plus_gap(), 26) is None


def test_overlap_by_1e_9_fails_and_scores_zero():
    bad = _grid_plus_gap(extra=1e-9)
    assert "overlap" in cp.check(bad, 26)
    assert cp.verify(bad, n=26) == 0.0


@pytest.mark.parametrize("bad, why", [
    ([[0.5, 0.5, 0.6]], "leaves"),
    ([[0.5, 0.5, -0.1]], "negative"),
    ([[0.5, float("nan"), 0.1]], "finite"),
    ([[0.5, 0.5]], "triples"),
    ("no packing here", "triples"),
])
def test_invalid_constructions_score_zero(bad, why):
    assert why in cp.check(bad)
    assert cp.verify(bad) == 0.0


def test_wrong_count_and_wall_tolerance():
    assert cp.verify(_grid_plus_gap()[:25], n=26) == 0.0
    assert cp.verify([[0.25, 0.5, 0.25 + 5e-13]]) > 0  # within 1e-12 of the wall
    assert cp.verify([[0.25, 0.5, 0.25 + 1e-9]]) == 0.0


def test_text_states_are_parsed():
    text = "here it is: " + str(_grid_plus_gap())
    assert cp.verify(text, n=26) == pytest.approx(2.541421, abs=1e-6)


@pytest.mark.parametrize("n", [1, 5, 26, 32])
def test_seeds_are_valid(n):
    seeds = cp.seeds(n)
    assert seeds
    for state in seeds:
        assert cp.check(state, n) is None
    assert cp.verify(seeds[0], n) >= max(cp.verify(s, n) for s in seeds)


def test_repair_makes_any_packing_valid():
    rng = np.random.default_rng(0)
    for _ in range(20):
        c = rng.uniform(-0.1, 1.1, size=(12, 3))
        assert cp.check(cp.repair(c), 12) is None


@pytest.mark.parametrize("op", cp.OPERATORS)
def test_every_operator_returns_a_valid_child(op):
    parent = cp.seeds(26)[0]
    for seed in range(5):
        child = cp.execute(parent, f"<guidance>{op}</guidance>", seed=seed)
        assert cp.check(child, 26) is None


def test_grow_never_loses_and_fills_slack():
    c = np.array(cp.seeds(26)[0]) * [1, 1, 0.5]
    grown = cp.grow(c, random.Random(0))
    assert grown[:, 2].sum() > c[:, 2].sum()
    assert cp.check(grown, 26) is None


def test_operators_can_improve_a_seed():
    task = cp.CirclePacking(26)
    parent = task.seeds()[0]
    best = task.score(parent)
    rng = random.Random(0)
    for i in range(60):
        child = task.execute(parent, rng.choice(cp.OPERATORS), seed=i)
        score = task.score(child)
        if score > best:
            best, parent = score, child
    assert best > task.score(task.seeds()[0]) + 1e-3


def test_guidance_maps_to_an_operator():
    assert cp.operator_for("please grow it") == "grow"
    assert cp.operator_for("x") in cp.OPERATORS
    with pytest.raises(ValueError):
        cp.operator_for("  ")
