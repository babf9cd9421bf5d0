"""Circle packing in the unit square (AlphaEvolve B.12; the TTT-Discover task): maximise the sum of radii.

A *state* is a packing: a list of ``[x, y, r]`` triples (JSON), or text holding such a JSON list. The verifier
recomputes everything and trusts no claim:

* exactly ``n`` circles, every value a finite number, every radius ``>= 0``;
* every circle inside ``[0, 1]²``: ``r <= x <= 1 - r`` and the same for ``y``, within :data:`TOLERANCE`;
* every pair apart: ``dist(c_i, c_j) >= r_i + r_j - TOLERANCE``.

The score is the sum of the radii; a construction that fails any rule scores 0. Reference values: n = 26
2.6359830849, n = 32 2.9395727712 (reef, Qwen3-8B on GPUs).

Seeds (:func:`seeds`) are simple valid constructions (grids with the spare circles in the gaps). The CPU executor
(:func:`execute`) turns a parent packing plus a guidance word into a child with a handful of geometric operators:

* ``perturb``: jitter every centre, relax (a short penalty-gradient ascent on the sum of radii: circles push
  apart and swell into free space), then repair and grow;
* ``grow``: enlarge every circle, in random order, to the largest radius its walls and neighbours allow;
* ``swap``: exchange the centres of two circles of different radius, then repair and grow;
* ``shrink``: take one circle out, let the others grow into its space, put it back in the largest hole found.

Every operator ends with :func:`repair` (shrink overlapping pairs and wall-crossers until the packing verifies), so
an executor child is always valid. Unknown guidance maps to an operator by its first letter (the CPU demo's guide
is a tiny random model).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import numpy as np

TOLERANCE = 1e-12
#: Best published sums of radii (reef's runs), by n.
REFERENCE = {26: 2.6359830849177777, 32: 2.9395727712074926}
OPERATORS = ("perturb", "grow", "swap", "shrink")

Circles = np.ndarray  # [n, 3]: x, y, r


def parse_state(state: Any) -> Circles | None:
    """The ``[n, 3]`` float array a state describes, or None when it is not a list of numeric triples."""
    if isinstance(state, str):
        text = state.strip()
        start, end = text.find("["), text.rfind("]")
        if start < 0 or end <= start:
            return None
        try:
            state = json.loads(text[start:end + 1])
        except ValueError:
            return None
    if isinstance(state, dict):
        state = state.get("circles")
    if not isinstance(state, (list, tuple)) or not state:
        return None
    rows = []
    for item in state:
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            return None
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in item):
            return None
        rows.append([float(v) for v in item])
    return np.asarray(rows, dtype=np.float64)


def check(circles: Any, n: int | None = None, tolerance: float = TOLERANCE) -> str | None:
    """Why ``circles`` is not a valid packing (of ``n`` circles, when given), or None when it is."""
    c = circles if isinstance(circles, np.ndarray) else parse_state(circles)
    if c is None or c.ndim != 2 or c.shape[1] != 3:
        return "not a list of [x, y, r] triples"
    if n is not None and c.shape[0] != n:
        return f"{c.shape[0]} circles, expected {n}"
    if not np.isfinite(c).all():
        return "a value is not finite"
    x, y, r = c[:, 0], c[:, 1], c[:, 2]
    if (r < 0).any():
        return "a radius is negative"
    if ((x - r) < -tolerance).any() or ((x + r) > 1 + tolerance).any() \
            or ((y - r) < -tolerance).any() or ((y + r) > 1 + tolerance).any():
        return "a circle leaves the unit square"
    dist = np.hypot(x[:, None] - x[None, :], y[:, None] - y[None, :])
    need = r[:, None] + r[None, :] - tolerance
    upper = np.triu(np.ones_like(dist, dtype=bool), k=1)
    if (upper & (dist < need)).any():
        i, j = np.argwhere(upper & (dist < need))[0]
        return f"circles {i} and {j} overlap"
    return None


def verify(circles: Any, n: int | None = None, tolerance: float = TOLERANCE) -> float:
    """The score: the sum of the radii of a valid packing, 0.0 for anything that fails :func:`check`."""
    c = circles if isinstance(circles, np.ndarray) else parse_state(circles)
    if c is None or check(c, n, tolerance) is not None:
        return 0.0
    return float(c[:, 2].sum())


def to_state(circles: Circles) -> list[list[float]]:
    """The JSON state of a packing."""
    return [[float(x), float(y), float(r)] for x, y, r in np.asarray(circles, dtype=np.float64)]


# --------------------------------------------------------------------------------------------------- seeds


def grid_with_gaps(n: int, k: int) -> Circles:
    """A ``k x k`` grid of equal circles; the circles beyond ``k²`` sit in the gaps between four grid circles
    (each as large as the gap allows); with fewer than ``k²`` circles the grid is cut short."""
    r = 0.5 / k
    centres = [((2 * i + 1) * r, (2 * j + 1) * r) for j in range(k) for i in range(k)]
    circles = [[x, y, r] for x, y in centres[:n]]
    gap_r = (math.sqrt(2) - 1) * r
    gaps = [((2 * i + 2) * r, (2 * j + 2) * r) for j in range(k - 1) for i in range(k - 1)]
    for x, y in gaps[:max(0, n - len(circles))]:
        circles.append([x, y, gap_r])
    while len(circles) < n:  # more circles than grid and gaps: zero-radius circles in a corner
        circles.append([0.0, 0.0, 0.0])
    return repair(np.asarray(circles, dtype=np.float64))


def rows_seed(n: int) -> Circles:
    """Rows of equal circles, as many rows as make them largest, then grown."""
    best = None
    for rows in range(1, n + 1):
        per_row = math.ceil(n / rows)
        r = min(0.5 / per_row, 0.5 / rows)
        circles = [[(2 * i + 1) * r, (2 * j + 1) * r, r] for j in range(rows) for i in range(per_row)][:n]
        c = np.asarray(circles, dtype=np.float64)
        if best is None or c[:, 2].sum() > best[:, 2].sum():
            best = c
    return grow(best, random.Random(0))


def seeds(n: int) -> list[list[list[float]]]:
    """Valid starting packings of ``n`` circles (JSON states), best first."""
    k = math.isqrt(n - 1) + 1  # the smallest grid holding every circle
    made = [grid_with_gaps(n, k), rows_seed(n)]
    made = [c for c in made if check(c, n) is None]
    made.sort(key=lambda c: -c[:, 2].sum())
    return [to_state(c) for c in made]


# --------------------------------------------------------------------------------------------------- operators


def repair(circles: Circles) -> Circles:
    """A valid packing close to ``circles``: centres clipped into the square, radii cut at the walls, then each
    overlapping pair shrunk in proportion until it only touches (one pass suffices: radii only decrease)."""
    c = np.array(circles, dtype=np.float64)
    c[:, :2] = np.clip(c[:, :2], 0.0, 1.0)
    c[:, 2] = np.clip(c[:, 2], 0.0, None)
    c[:, 2] = np.minimum.reduce([c[:, 2], c[:, 0], 1 - c[:, 0], c[:, 1], 1 - c[:, 1]])
    n = len(c)
    for i in range(n):
        for j in range(i + 1, n):
            d = math.hypot(c[i, 0] - c[j, 0], c[i, 1] - c[j, 1])
            total = c[i, 2] + c[j, 2]
            if total > d:
                scale = d / total if total > 0 else 0.0
                c[i, 2] *= scale
                c[j, 2] *= scale
    return c


def max_radius(c: Circles, i: int) -> float:
    """The largest radius circle ``i`` may take with every other circle fixed."""
    x, y = c[i, 0], c[i, 1]
    limit = min(x, 1 - x, y, 1 - y)
    others = np.delete(c, i, axis=0)
    if len(others):
        gaps = np.hypot(others[:, 0] - x, others[:, 1] - y) - others[:, 2]
        limit = min(limit, float(gaps.min()))
    return max(0.0, limit)


def grow(circles: Circles, rng: random.Random) -> Circles:
    """Every circle, in random order, enlarged (or cut) to :func:`max_radius`: valid, and never smaller in total
    than a valid input."""
    c = repair(circles)
    order = list(range(len(c)))
    rng.shuffle(order)
    for i in order:
        c[i, 2] = max_radius(c, i)
    return c


def relax(circles: Circles, steps: int = 300, lr: float = 0.002, mu: float = 50.0) -> Circles:
    """Gradient ascent on ``Σ r − μ (Σ overlaps² + Σ wall crossings²)`` over centres and radii (a penalty method):
    circles push apart and swell into free space. The result may overlap slightly; callers repair it."""
    c = np.array(circles, dtype=np.float64)
    x, y, r = c[:, 0].copy(), c[:, 1].copy(), c[:, 2].copy()
    for _ in range(steps):
        dx, dy = x[:, None] - x[None, :], y[:, None] - y[None, :]
        d = np.sqrt(dx ** 2 + dy ** 2) + 1e-12
        overlap = np.maximum(0.0, r[:, None] + r[None, :] - d)
        np.fill_diagonal(overlap, 0.0)
        left, right = np.maximum(0.0, r - x), np.maximum(0.0, x + r - 1)
        low, high = np.maximum(0.0, r - y), np.maximum(0.0, y + r - 1)
        grad_r = 1.0 - 2 * mu * (overlap.sum(axis=1) + left + right + low + high)
        grad_x = 2 * mu * ((overlap * dx / d).sum(axis=1) + left - right)
        grad_y = 2 * mu * ((overlap * dy / d).sum(axis=1) + low - high)
        x, y, r = x + lr * grad_x, y + lr * grad_y, np.maximum(0.0, r + lr * grad_r)
    return np.stack([x, y, r], axis=1)


def perturb(circles: Circles, rng: random.Random, sigma: float = 0.03) -> Circles:
    """Jitter every centre by a small random step, relax (:func:`relax`), then repair and grow."""
    c = np.array(circles, dtype=np.float64)
    c[:, :2] += np.array([[rng.gauss(0.0, sigma), rng.gauss(0.0, sigma)] for _ in range(len(c))])
    return grow(repair(relax(c)), rng)


def swap(circles: Circles, rng: random.Random) -> Circles:
    c = np.array(circles, dtype=np.float64)
    if len(c) >= 2:
        i, j = rng.sample(range(len(c)), 2)
        c[[i, j], :2] = c[[j, i], :2]
    return grow(repair(c), rng)


def shrink(circles: Circles, rng: random.Random, candidates: int = 256) -> Circles:
    """Take one random circle out (radius 0), grow the others into its space, then put it back at the best of
    ``candidates`` random points (where it can be largest) and grow everything again."""
    c = np.array(circles, dtype=np.float64)
    i = rng.randrange(len(c))
    c[i, 2] = 0.0
    c = grow(c, rng)
    best, where = -1.0, (c[i, 0], c[i, 1])
    for _ in range(candidates):
        c[i, 0], c[i, 1] = rng.random(), rng.random()
        room = max_radius(c, i)
        if room > best:
            best, where = room, (c[i, 0], c[i, 1])
    c[i, 0], c[i, 1] = where
    c[i, 2] = 0.0
    return grow(c, rng)


_OPS = {"perturb": perturb, "grow": grow, "swap": swap, "shrink": shrink}


def operator_for(guidance: str) -> str:
    """The operator a guidance text names: an operator's name in it, else the first letter's position
    (``p``/``g``/``s``... by character code), so any non-empty text maps to one."""
    text = (guidance or "").strip().lower()
    for name in OPERATORS:
        if name in text:
            return name
    if not text:
        raise ValueError("empty guidance")
    return OPERATORS[ord(text[0]) % len(OPERATORS)]


def execute(parent: Any, guidance: str, *, seed: int | None = None) -> list[list[float]]:
    """The CPU executor of Guidance-TTT: parent packing + guidance -> a valid child packing (JSON state)."""
    c = parse_state(parent)
    if c is None:
        raise ValueError("the parent is not a packing")
    rng = random.Random(seed)
    return to_state(_OPS[operator_for(guidance)](c, rng))


# --------------------------------------------------------------------------------------------------- the task


class CirclePacking:
    """The task object of reef-ttt: seeds, prompts, verifier and the CPU executor for ``n`` circles."""

    def __init__(self, n: int = 26):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"circle packing: n must be a positive integer, got {n!r}")
        self.n = n
        self.name = f"circle_packing_{n}"

    def seeds(self) -> list[Any]:
        return seeds(self.n)

    def score(self, state: Any) -> float | None:
        """The verified sum of radii, or None for a state that is not a valid packing of ``n`` circles."""
        c = parse_state(state)
        if c is None or check(c, self.n) is not None:
            return None
        return float(c[:, 2].sum())

    def describe(self, state: Any) -> str:
        c = parse_state(state)
        return json.dumps(to_state(np.round(c, 6))) if c is not None else str(state)

    def prompt(self, state: Any, value: float, *, guidance: bool = False) -> list[dict]:
        goal = (f"Pack {self.n} circles in the unit square without overlap, maximising the sum of their radii. "
                f"Each circle is [x, y, r].")
        if guidance:
            ops = ", ".join(OPERATORS)
            return [{"role": "user", "content": (
                f"{goal} The current packing scores {value:.6f}. Say which operator to apply next ({ops}) as "
                "<guidance>operator</guidance>.")}]
        return [{"role": "user", "content": (
            f"{goal} Improve this packing (sum of radii {value:.6f}) and reply with the new JSON list:\n"
            f"{self.describe(state)}")}]

    def execute(self, parent: Any, guidance: str, *, seed: int | None = None) -> list[list[float]]:
        return execute(parent, guidance, seed=seed)


def make_task(n: int = 26) -> CirclePacking:
    """Task factory for ``recipe.options.task`` (``reef_ttt.tasks.circle_packing:make_task``, ``task_options:
    {n: 26}``)."""
    return CirclePacking(n)


__all__ = ["TOLERANCE", "REFERENCE", "OPERATORS", "parse_state", "check", "verify", "to_state", "seeds", "repair",
           "grow", "perturb", "relax", "swap", "shrink", "operator_for", "execute", "CirclePacking", "make_task",
           "grid_with_gaps", "max_radius"]

