"""The canary's decision rule: a one-sided Welch t-test of mean(canary) - mean(production) on reported scores.

Once both sides have at least ``min_scored`` scored records, the difference ``d`` of the means is tested with Welch's
unequal-variance t statistic ``t = d / se`` (``se`` from each side's sample variance, degrees of freedom by the
Welch-Satterthwaite formula), one-sided each way at level ``alpha``:

* ``p_better = P(T >= t)`` below ``alpha``: the canary is better, it is **promoted**;
* ``p_worse = P(T <= t)`` below ``alpha``: the canary is worse, it is **rolled back**;
* otherwise the canary keeps collecting, until both sides reach ``max_scored`` (when set): then it is rolled back as
  inconclusive (a canary must show it is better to replace what serves).

Both tests at ``alpha`` each: at most one of them can pass for ``alpha < 0.5``. Two sides that are both constant
(``se = 0``) decide by the sign of ``d``. The evidence (counts, means, variances, ``t``, ``df``, both p-values and
the one-sided ``1 - alpha`` bounds of ``d``) is what the decision release keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The rule's name in config (``evaluation.rollout.rule``, :data:`reef_core.config.rollout.RULES`) and evidence.
RULE = "welch_t"
PROMOTE, ROLLBACK, COLLECTING = "promote", "rollback", "collecting"


@dataclass
class Side:
    """Running moments of one side's scores: n, mean and the sum of squared deviations (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    def remove(self, x: float) -> None:
        """Take back one earlier score (a later report replaced it)."""
        if self.n <= 1:
            self.n, self.mean, self.m2 = 0, 0.0, 0.0
            return
        old_mean = (self.mean * self.n - x) / (self.n - 1)
        self.m2 = max(0.0, self.m2 - (x - old_mean) * (x - self.mean))
        self.n -= 1
        self.mean = old_mean

    @property
    def variance(self) -> float | None:
        return self.m2 / (self.n - 1) if self.n > 1 else None

    def row(self) -> dict:
        return {"scored": self.n, "mean": self.mean if self.n else None, "variance": self.variance}


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`; 0 < p < 1)."""
    low, high = -1e3, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def decide(canary: Side, production: Side, *, alpha: float, min_scored: int, max_scored: int | None) -> dict:
    """The rule's answer on the scores so far: ``decision`` (promote, rollback or collecting), ``why`` and the
    evidence. Values are finite or None (the answer is stored as JSON)."""
    out = {"rule": RULE, "alpha": alpha, "min_scored": min_scored, "max_scored": max_scored,
           "canary": canary.row(), "production": production.row(), "difference": None, "t": None, "df": None,
           "p_better": None, "p_worse": None, "lower": None, "upper": None}
    if min(canary.n, production.n) < min_scored:
        return {**out, "decision": COLLECTING,
                "why": f"each side needs {min_scored} scored records (canary {canary.n}, production {production.n})"}
    d = canary.mean - production.mean
    out["difference"] = d
    var_c, var_p = canary.variance or 0.0, production.variance or 0.0
    se2 = var_c / canary.n + var_p / production.n
    if se2 > 0:
        se = math.sqrt(se2)
        denominator = ((var_c / canary.n) ** 2 / (canary.n - 1) + (var_p / production.n) ** 2 / (production.n - 1))
        df = se2 * se2 / denominator if denominator > 0 else float(canary.n + production.n - 2)
        t = d / se
        p_worse = t_cdf(t, df)
        p_better = 1.0 - p_worse
        margin = t_quantile(1.0 - alpha, df) * se
        out.update(t=t, df=df, p_better=p_better, p_worse=p_worse, lower=d - margin, upper=d + margin)
    else:  # both sides constant: the sign of the difference is certain
        p_better = 0.0 if d > 0 else 1.0 if d < 0 else 0.5
        p_worse = 0.0 if d < 0 else 1.0 if d > 0 else 0.5
        out.update(p_better=p_better, p_worse=p_worse, lower=d, upper=d)
    if p_better < alpha:
        return {**out, "decision": PROMOTE,
                "why": f"one-sided Welch t-test: canary better than production, p = {p_better:.3g} < alpha {alpha:g}"}
    if p_worse < alpha:
        return {**out, "decision": ROLLBACK,
                "why": f"one-sided Welch t-test: canary worse than production, p = {p_worse:.3g} < alpha {alpha:g}"}
    if max_scored is not None and min(canary.n, production.n) >= max_scored:
        return {**out, "decision": ROLLBACK,
                "why": f"inconclusive after {max_scored} scored records a side (p_better = {p_better:.3g}, "
                       f"p_worse = {p_worse:.3g}, alpha {alpha:g}): a canary must show it is better"}
    return {**out, "decision": COLLECTING,
            "why": f"no one-sided difference at alpha {alpha:g} yet (p_better = {p_better:.3g}, "
                   f"p_worse = {p_worse:.3g})"}
