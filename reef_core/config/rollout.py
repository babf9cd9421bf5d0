"""The values ``evaluation.rollout`` may take (its keys are typed by :class:`~reef_core.config.schema.RolloutConfig`,
so an unknown key is refused when the config is composed). Each refusal names the key."""

from __future__ import annotations

import math
import re

from ..errors import ConfigError

STRATEGIES = ("immediate", "canary", "ab")
#: The canary's decision rules: ``welch_t``, the one-sided Welch t-test of :mod:`reef_core.commit.canary`.
RULES = ("welch_t",)
#: A tag name as ``x-reef-tag-<name>`` stores it (lowercased).
_TAG = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
KEY = "evaluation.rollout"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_rollout(rollout) -> None:
    """Refuse a rollout that cannot run, naming ``evaluation.rollout.<key>``."""
    if rollout.strategy not in STRATEGIES:
        raise ConfigError(f"{KEY}.strategy must be one of {', '.join(STRATEGIES)}, not {rollout.strategy!r}")
    if not isinstance(rollout.sticky, str) or not _TAG.fullmatch(rollout.sticky):
        raise ConfigError(f"{KEY}.sticky must be a tag name (lowercase letters, digits, '_', '.', '-'; the tag of "
                          f"x-reef-tag-<name>), not {rollout.sticky!r}")
    if not _number(rollout.share) or not 0 < rollout.share < 1:
        raise ConfigError(f"{KEY}.share must be a number between 0 and 1 (exclusive), not {rollout.share!r}")
    if rollout.rule not in RULES:
        raise ConfigError(f"{KEY}.rule must be one of {', '.join(RULES)}, not {rollout.rule!r}")
    if not _number(rollout.alpha) or not 0 < rollout.alpha < 0.5:
        raise ConfigError(f"{KEY}.alpha must be a number between 0 and 0.5 (exclusive), not {rollout.alpha!r}")
    if isinstance(rollout.min_scored, bool) or not isinstance(rollout.min_scored, int) or rollout.min_scored < 2:
        raise ConfigError(f"{KEY}.min_scored must be an integer of at least 2 (a variance needs two scores), "
                          f"not {rollout.min_scored!r}")
    if rollout.max_scored is not None and (isinstance(rollout.max_scored, bool) or not isinstance(
            rollout.max_scored, int) or rollout.max_scored < rollout.min_scored):
        raise ConfigError(f"{KEY}.max_scored must be null or an integer of at least min_scored "
                          f"({rollout.min_scored}), not {rollout.max_scored!r}")
    arms = list(rollout.arms or [])
    if rollout.strategy != "ab":
        if arms:
            raise ConfigError(f"{KEY}.arms are the releases of strategy ab; strategy {rollout.strategy!r} takes none")
        return
    if len(arms) < 2:
        raise ConfigError(f"{KEY}.arms: strategy ab needs at least two arms ({{release, share}}), not {len(arms)}")
    seen = set()
    for i, arm in enumerate(arms):
        if not isinstance(arm.release, str) or not arm.release.strip() or len(arm.release) > 200:
            raise ConfigError(f"{KEY}.arms[{i}].release must name a release id or an alias of the scenario")
        if arm.release in seen:
            raise ConfigError(f"{KEY}.arms[{i}].release: {arm.release!r} is named twice")
        seen.add(arm.release)
        if not _number(arm.share) or not 0 < arm.share < 1:
            raise ConfigError(f"{KEY}.arms[{i}].share must be a number between 0 and 1 (exclusive), "
                              f"not {arm.share!r}")
    total = math.fsum(arm.share for arm in arms)
    if abs(total - 1.0) > 1e-6:
        raise ConfigError(f"{KEY}.arms: the shares must sum to 1, not {total:g}")
