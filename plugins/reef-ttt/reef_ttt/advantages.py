"""Per-group advantage estimators of TTT-Discover (upstream ``compute_advantages``), computed in float32.

``entropic_adaptive_beta`` (the default): the leave-one-out entropic advantage with β solved per group so that the
tilted distribution ``q_β(i) ∝ exp(β (r_i − max r))`` sits at ``KL(q_β ‖ uniform) = ln 2``::

    β search: lo = 0, hi = 1; double hi while KL(hi) < ln 2 and hi < 1e6
              KL(hi) still < ln 2: β = hi (the cap; a constant group lands here and gets A = 0)
              else 60 bisection steps, KL(mid) < ln 2 -> lo = mid else hi = mid; β = hi
    e_i = exp(β (r_i − max r)),  Z_i = (Σ_j e_j − e_i) / (k − 1),  A_i = e_i / (Z_i + 1e-12) − 1

No normalisation: the estimator is invariant to ``r -> a r + b`` (a > 0). ``entropic`` uses a fixed β (2.0);
``mean_baseline`` is ``r − mean r``. A group of fewer than 2 rewards gets A = 0. R = 2 is degenerate under the
adaptive β (the winner's baseline underflows; A ≈ 1e12): the recipe requires R >= 3.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

ESTIMATORS = ("entropic_adaptive_beta", "entropic", "mean_baseline")
TARGET_KL = math.log(2.0)
BETA_CAP = 1e6
BISECTION_STEPS = 60
FIXED_BETA = 2.0


def _kl_to_uniform(delta: torch.Tensor, beta: float) -> float:
    logq = torch.log_softmax(delta * beta, dim=0)
    return float((logq.exp() * (logq + math.log(delta.numel()))).sum())


def solve_beta(rewards: Sequence[float] | torch.Tensor) -> float:
    """The adaptive β of one group (see the module docstring); 0.0 for fewer than two rewards."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if r.numel() < 2:
        return 0.0
    delta = r - r.max()
    lo, hi = 0.0, 1.0
    while _kl_to_uniform(delta, hi) < TARGET_KL and hi < BETA_CAP:
        hi *= 2.0
    if _kl_to_uniform(delta, hi) < TARGET_KL:
        return hi
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2.0
        if _kl_to_uniform(delta, mid) < TARGET_KL:
            lo = mid
        else:
            hi = mid
    return hi


def entropic_loo(rewards: Sequence[float] | torch.Tensor, beta: float) -> torch.Tensor:
    """Leave-one-out entropic advantages of one group at a given β (float32)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    k = r.numel()
    if k < 2:
        return torch.zeros_like(r)
    e = torch.exp(torch.tensor(beta, dtype=torch.float32) * (r - r.max()))
    z = (e.sum() - e) / (k - 1)
    return e / (z + 1e-12) - 1.0


def group_advantages(rewards: Sequence[float] | torch.Tensor, estimator: str = "entropic_adaptive_beta"
                     ) -> tuple[torch.Tensor, float]:
    """``(advantages, beta)`` of one group; beta is 0.0 for ``mean_baseline``."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if estimator == "entropic_adaptive_beta":
        beta = solve_beta(r)
        return entropic_loo(r, beta), beta
    if estimator == "entropic":
        return entropic_loo(r, FIXED_BETA), FIXED_BETA
    if estimator == "mean_baseline":
        return (r - r.mean()) if r.numel() else r, 0.0
    raise ValueError(f"unknown advantage estimator {estimator!r} (known: {', '.join(ESTIMATORS)})")
