"""Rollouts on live traffic (``evaluation.rollout``): which release serves a request, and the canary's tally.

* **Assignment is sticky**: a request's key is the value of its tag ``rollout.sticky`` (``x-reef-tag-session`` by
  default), else its record id; :func:`unit` hashes (scenario, salt, key) to a number in [0, 1), so one key always
  lands on one side, across restarts and processes. The salt is the canary's release id (a new canary draws its
  share afresh) or ``ab`` (the arms keep their keys while the config holds).
* **The canary** is a selected release held out of the chain (like a release held for review) whose source carries
  ``rollout``; it serves ``share`` of traffic through the harness surface's per-request path (the pinning path), and
  every request assigned while it runs records ``payload.rollout = {strategy, canary, arm}``. The learner tallies
  the scores reported on those records per arm (:class:`CanaryTally`) and applies the rule
  (:mod:`reef_core.commit.canary`). Its state is the release chain: a canary is running while no release records a
  decision on it (:func:`running_canary`), so a restart finds it, and the tally is rebuilt from the records.
* Only a surface that serves two releases at once (harness trees: :func:`~reef_core.loop.aliases.pinnable`) can
  roll out; :func:`check_binding` refuses the others at start-up.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..commit.canary import Side
from ..errors import ConfigError
from .aliases import pinnable
from .release_compare import reported_score

CANARY, PRODUCTION = "canary", "production"


def unit(scenario: str, salt: str, key: str) -> float:
    """A deterministic number in [0, 1) for (scenario, salt, key)."""
    digest = hashlib.sha256("\x00".join((scenario, salt, key)).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def sticky_key(tags: dict | None, record_id: str, tag: str) -> str:
    value = (tags or {}).get(tag)
    return f"tag:{value}" if value else f"record:{record_id}"


def in_canary(scenario: str, canary_id: str, key: str, share: float) -> bool:
    return unit(scenario, canary_id, key) < share


def ab_arm(scenario: str, arms: list, key: str) -> int:
    """The index of the arm ``key`` falls in (arms' shares in config order, summing to 1)."""
    point, upto = unit(scenario, "ab", key), 0.0
    for i, arm in enumerate(arms):
        upto += arm.share
        if point < upto:
            return i
    return len(arms) - 1


def check_binding(binding, surface, *, role: str, workers: int) -> None:
    """Refuse at start-up a rollout that this deployment cannot run, naming the key and why."""
    rollout = binding.evaluation.rollout
    if rollout.strategy == "immediate":
        return
    where = "" if binding.default else f"{binding.where()}: "
    key = f"evaluation.rollout.strategy={rollout.strategy}"
    if surface is None or not pinnable(surface):
        kind = "skills" if getattr(surface, "serves_skills", False) else getattr(surface, "kind", None) or "no"
        raise ConfigError(f"{where}{key}: recipe {binding.name!r} has {kind} surface, which serves one release at a "
                          "time; canary and A/B rollouts serve two releases at once, which only a harness tree "
                          "surface can (set evaluation.rollout.strategy=immediate)")
    if rollout.strategy == "canary" and binding.evaluation.publish != "auto":
        raise ConfigError(f"{where}{key}: a canary is how a selected release is published; it needs "
                          f"evaluation.publish=auto, not {binding.evaluation.publish!r}")
    if role != "all" or workers > 1:
        raise ConfigError(f"{where}{key}: requests are assigned where the scenario's learner runs; it needs one "
                          "process that serves and learns (server.learner=true, server.workers=1)")


@dataclass
class Canary:
    """The running canary: its release, the head it is compared with when it started, and its settings."""

    release_id: str
    share: float
    sticky: str
    started_at: str | None
    production_release_id: str | None

    def row(self) -> dict:
        return {"release_id": self.release_id, "share": self.share, "sticky": self.sticky,
                "started_at": self.started_at, "production_release_id_at_start": self.production_release_id}


def canary_source(rollout) -> dict:
    """What a canary release's source keeps of its rollout (its settings at the time it started)."""
    return {"strategy": "canary", "share": rollout.share, "sticky": rollout.sticky, "rule": rollout.rule,
            "alpha": rollout.alpha, "min_scored": rollout.min_scored, "max_scored": rollout.max_scored,
            "train_canary": rollout.train_canary}


def decision_of(release) -> dict | None:
    """The canary decision a release records (``source.canary``), or None."""
    found = (release.source or {}).get("canary")
    return found if isinstance(found, dict) and isinstance(found.get("release_id"), str) else None


def running_canary(releases: list, head_id: str | None) -> Canary | None:
    """The canary no release has decided on yet, from the scenario's releases (newest first): a held release whose
    source names a canary rollout, neither promoted nor named by a later decision."""
    decided = set()
    for release in releases:
        found = decision_of(release)
        if found is not None:
            decided.add(found["release_id"])
        if release.operation == "promote":
            decided.add((release.source or {}).get("release_id"))
    for release in releases:
        rollout = (release.source or {}).get("rollout")
        if not release.pending or not isinstance(rollout, dict) or rollout.get("strategy") != CANARY:
            continue
        if release.release_id in decided:
            return None  # the newest canary was decided: none runs
        return Canary(release.release_id, float(rollout.get("share", 0.0)), str(rollout.get("sticky", "session")),
                      release.created_at, release.parent_release_id or head_id)
    return None


@dataclass
class CanaryTally:
    """Reported scores of the records assigned while one canary runs, by arm; a record reported again keeps its
    latest score (as the release comparison counts it). Fed the scenario's records in order."""

    canary_id: str
    sides: dict[str, Side] = field(default_factory=lambda: {CANARY: Side(), PRODUCTION: Side()})
    arms: dict[str, str] = field(default_factory=dict)  # record id -> arm
    scores: dict[str, float] = field(default_factory=dict)  # record id -> its latest score
    #: A score arrived since the rule last looked.
    changed: bool = False

    def observe(self, record) -> None:
        if record.kind == "inference":
            info = record.payload.get("rollout")
            if isinstance(info, dict) and info.get("canary") == self.canary_id and info.get("arm") in self.sides:
                self.arms[record.record_id] = info["arm"]
        elif record.kind == "report":
            score = reported_score(record.payload.get("score"))
            if score is None:
                return
            for ref in record.references:
                arm = self.arms.get(ref)
                if arm is None:
                    continue
                side = self.sides[arm]
                if ref in self.scores:
                    side.remove(self.scores[ref])
                side.add(score)
                self.scores[ref] = score
                self.changed = True
