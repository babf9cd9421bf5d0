"""Reported scores grouped by the release that served each record, and the comparison of two releases.

A scenario's inference records carry the version that served them (``Record.version``: a harness release id, or a
weights line ``<incarnation>:<seq>`` that the release rows list under ``metrics.serving_versions``). A report's
finite ``score`` belongs to every record it quotes; a record reported twice keeps its latest score (a later report
corrects an earlier one), and the unscored sentinel (``score: null``) counts for nothing. Scores are grouped by
release in the order the releases first served, which is the order the dashboard plots them.

The comparison is unpaired (the two releases served different requests): a bootstrap of the difference of means
``b - a``, each side resampled with replacement, :data:`REPLICATES` times from one fixed seed, so the same records
give the same interval on every call.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: Bootstrap resamples of each comparison (stated in the answer), and the seed of their generator.
REPLICATES = 2000
SEED = 0
CONFIDENCE = 0.95


@dataclass
class ReleaseScores:
    """The scored records one release served."""

    release_id: str
    #: ``created_at`` of the first record it served (seconds since the epoch).
    first_served_at: float
    scores: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float | None:
        return math.fsum(self.scores) / len(self.scores) if self.scores else None

    def row(self) -> dict:
        return {"release_id": self.release_id, "scored": len(self.scores), "mean": self.mean,
                "first_served_at": self.first_served_at}


def version_table(release_rows: Iterable[Mapping]) -> dict[str, str]:
    """``served version -> release id`` from the release rows: a release's id is its own version (harness), and
    every version that served it (``metrics.serving_versions``, ``serving_version``) maps to it (weights)."""
    table: dict[str, str] = {}
    for row in release_rows:
        release_id = row.get("release_id")
        if not isinstance(release_id, str):
            continue
        metrics = row.get("metrics") or {}
        versions = list(metrics.get("serving_versions") or []) + [metrics.get("serving_version")]
        for version in versions:
            if isinstance(version, str):
                table.setdefault(version, release_id)
        table[release_id] = release_id
    return table


def reported_score(value) -> float | None:
    """A report's ``score`` as a finite float; None for the unscored sentinel, booleans and anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def scores_by_release(records: Iterable, versions: Mapping[str, str]) -> tuple[list[ReleaseScores], int]:
    """Per release (in the order each first served) its records' reported scores, and the number of scored records
    no release of the chain served (an engine version outside it, e.g. a scenario without a surface).

    ``records`` are the scenario's records oldest first (a report comes after what it quotes)."""
    served: dict[str, tuple[str | None, float]] = {}  # inference id -> (release id, created_at)
    latest: dict[str, float] = {}  # inference id -> its latest reported score
    for record in records:
        if record.kind == "inference":
            release = versions.get(record.version) if record.version else None
            if release is None:
                release = versions.get(record.payload.get("release_id"))
            served[record.record_id] = (release, record.created_at)
        elif record.kind == "report":
            score = reported_score(record.payload.get("score"))
            if score is None:
                continue
            for ref in record.references:
                if ref in served:
                    latest[ref] = score
    groups: dict[str, ReleaseScores] = {}
    unattributed = 0
    for record_id, (release, created_at) in served.items():  # insertion order: the order records were stored
        group = groups.get(release) if release is not None else None
        if release is not None and group is None:
            group = groups[release] = ReleaseScores(release, created_at)
        if record_id in latest:
            if group is None:
                unattributed += 1
            else:
                group.scores.append(latest[record_id])
    return list(groups.values()), unattributed


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated between neighbours."""
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def bootstrap_difference(a: list[float], b: list[float], *, replicates: int = REPLICATES, seed: int = SEED,
                         confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The percentile bootstrap interval of ``mean(b) - mean(a)``, each side resampled on its own; None when a
    side has no score."""
    if not a or not b:
        return None
    rng = random.Random(seed)
    diffs = sorted(math.fsum(rng.choices(b, k=len(b))) / len(b) - math.fsum(rng.choices(a, k=len(a))) / len(a)
                   for _ in range(replicates))
    tail = (1 - confidence) / 2
    return _quantile(diffs, tail), _quantile(diffs, 1 - tail)


def compare(groups: list[ReleaseScores], a: str, b: str) -> dict:
    """The comparison of releases ``a`` and ``b`` (ids; a release that served nothing scored has count 0)."""
    by_id = {g.release_id: g for g in groups}
    side_a, side_b = by_id.get(a, ReleaseScores(a, 0.0)), by_id.get(b, ReleaseScores(b, 0.0))
    interval = bootstrap_difference(side_a.scores, side_b.scores)
    mean_a, mean_b = side_a.mean, side_b.mean
    return {
        "a": {"release_id": a, "scored": len(side_a.scores), "mean": mean_a},
        "b": {"release_id": b, "scored": len(side_b.scores), "mean": mean_b},
        "difference": {
            "mean": mean_b - mean_a if mean_a is not None and mean_b is not None else None,
            "low": interval[0] if interval else None,
            "high": interval[1] if interval else None,
            "confidence": CONFIDENCE,
            "method": "unpaired percentile bootstrap of mean(b) - mean(a), each side resampled with replacement",
            "replicates": REPLICATES,
            "seed": SEED,
        },
    }
