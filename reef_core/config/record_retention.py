"""Checks of the record keys of ``storage.retention`` (``max_age``, ``max_bytes``, ``keep_scored``,
``interval_s``, ``chunk_records``, ``max_records_per_pass`` and the per-scenario ``scenarios`` rules), and the
effective policy of one scenario. Every refusal names its key, at start-up, before anything is written."""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
#: ``max_age`` of a per-scenario rule that turns expiry off where the deployment has it on.
FOREVER = "forever"


def parse_duration(value: Any, key: str) -> float | None:
    """Seconds of ``30d``, ``12h``, ``15m``, ``45s``, ``2w`` or a plain number of seconds; ``None``/``forever``
    for no limit. ConfigError naming ``key`` otherwise (zero and negative durations too)."""
    if value is None or value == FOREVER:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be a duration such as 30d, 12h or 900s, or null; got {value!r}", key=key)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        found = _DURATION.match(str(value))
        if found is None:
            raise ConfigError(f"{key} must be a duration such as 30d, 12h or 900s, or null; got {value!r}", key=key)
        seconds = float(found.group(1)) * _UNITS[found.group(2) or "s"]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{key} must be a positive duration, got {value!r}", key=key)
    return seconds


def _check_bytes(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key} must be a non-negative number of bytes or null, got {value!r}", key=key)
    return value


def _check_count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}", key=key)
    return value


def check_record_retention(section) -> None:
    """Refuse a bad record key of ``storage.retention`` (a :class:`~reef_core.config.schema.RetentionConfig`)."""
    where = "storage.retention"
    parse_duration(section.max_age, f"{where}.max_age")
    _check_bytes(section.max_bytes, f"{where}.max_bytes")
    if not isinstance(section.keep_scored, bool):
        raise ConfigError(f"{where}.keep_scored must be true or false", key=f"{where}.keep_scored")
    interval = section.interval_s
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not math.isfinite(interval) \
            or interval < 0:
        raise ConfigError(f"{where}.interval_s must be a non-negative number of seconds (0: no background pass), "
                          f"got {interval!r}", key=f"{where}.interval_s")
    _check_count(section.chunk_records, f"{where}.chunk_records")
    _check_count(section.max_records_per_pass, f"{where}.max_records_per_pass")
    for i, rule in enumerate(section.scenarios):
        key = f"{where}.scenarios[{i}]"
        if not isinstance(rule.pattern, str) or not rule.pattern:
            raise ConfigError(f"{key}.pattern must be a non-empty fnmatch pattern", key=f"{key}.pattern")
        parse_duration(rule.max_age, f"{key}.max_age")
        _check_bytes(rule.max_bytes, f"{key}.max_bytes")
        if rule.keep_scored is not None and not isinstance(rule.keep_scored, bool):
            raise ConfigError(f"{key}.keep_scored must be true, false or null", key=f"{key}.keep_scored")


@dataclass(frozen=True)
class ScenarioRetention:
    """The record retention in force for one scenario: plain numbers, what the record store's compactor takes."""

    max_age_s: float | None = None
    #: this scenario's own body budget (a ``scenarios`` rule's ``max_bytes``); the deployment's is separate
    max_bytes: int | None = None
    keep_scored: bool = True


def scenario_retention(section, scenario: str) -> ScenarioRetention:
    """The first ``scenarios`` rule matching ``scenario`` over the deployment's keys: its ``max_age``
    (``forever``: none) and ``keep_scored`` replace the deployment's unless null; its ``max_bytes`` is a budget of
    the scenario's own (the deployment's ``max_bytes`` bounds all scenarios together)."""
    max_age = parse_duration(section.max_age, "storage.retention.max_age")
    keep_scored, max_bytes = bool(section.keep_scored), None
    for rule in section.scenarios:
        if fnmatch.fnmatchcase(scenario, rule.pattern):
            if rule.max_age is not None:
                max_age = parse_duration(rule.max_age, "storage.retention.scenarios.max_age")
            if rule.keep_scored is not None:
                keep_scored = bool(rule.keep_scored)
            max_bytes = rule.max_bytes
            break
    return ScenarioRetention(max_age_s=max_age, max_bytes=max_bytes, keep_scored=keep_scored)
