"""Per-group advantage estimators of TTT-Discover (upstream ``compute_advantages``), computed in float32.

``entropic_adaptive_beta`` (the default): the leave-one-out entropic advantage with β solved per group so that the
tilted distribution ``q_β(i) ∝ exp(β (r_i − max r))`` sits at ``KL(q_β ‖ uniform) = ln 2``::

    β search: lo = 0, hi = 1; double hi while KL(hi) < ln 2 and hi < 1e6
              KL(hi) still < ln 2: β = hi (the cap; a constant group lands here and gets A = 0)
              else 60 bisection steps, KL(mid) < ln 2 -> lo = mid else hi = mid; β = hi
    e_i = exp(β (r_i − max r)),  Z_i = (Σ_j e_j − e_i) / (k − 1),  A_i = e_i / (Z_i + 1e-12) − 1

The entropic maths is reef-core's (``reef_core.api.entropic_beta`` and ``entropic_loo``: one estimator, not a copy
here). No normalisation: the estimator is invariant to ``r -> a r + b`` (a > 0). ``entropic`` uses a fixed β (2.0);
``mean_baseline`` is ``r − mean r``. A group of fewer than 2 rewards gets A = 0. R = 2 is degenerate under the
adaptive β (the winner's baseline underflows; A ≈ 1e12): the recipe requires R >= 3.
"""

from __future__ import annotations

from typing import Sequence

import torch

from reef_core.api import entropic_beta, entropic_loo

ESTIMATORS = ("entropic_adaptive_beta", "entropic", "mean_baseline")
FIXED_BETA = 2.0


def group_advantages(rewards: Sequence[float] | torch.Tensor, estimator: str = "entropic_adaptive_beta"
                     ) -> tuple[torch.Tensor, float]:
    """``(advantages, beta)`` of one group; beta is 0.0 for ``mean_baseline``."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if estimator == "entropic_adaptive_beta":
        beta = entropic_beta(r)
        return entropic_loo(r, beta), beta
    if estimator == "entropic":
        return entropic_loo(r, FIXED_BETA), FIXED_BETA
    if estimator == "mean_baseline":
        return (r - r.mean()) if r.numel() else r, 0.0
    raise ValueError(f"unknown advantage estimator {estimator!r} (known: {', '.join(ESTIMATORS)})")
