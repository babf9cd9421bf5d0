"""Which records and samples may train: versions, staleness, and record hygiene.

Versions. The version that served an inference (``Record.version``) is ``"<incarnation>:<seq>"``, or
``"<incarnation>.<key>:<seq>"`` on a LoRA scenario's adapter line; the grammar is :mod:`reef_core.versions`
(:func:`~reef_core.versions.parse_version`, :func:`~reef_core.versions.on_line`).

Staleness (``max_staleness``, counted in versions). ``None`` disables the check (text-artifact recipes). ``0`` admits
only samples every turn of which the currently serving version produced; ``W`` admits ``0 <= serving_seq -
producing_seq <= W`` within the serving incarnation. Another incarnation never trains. Versions that do not parse are
admitted only when they equal the serving version exactly. A sample is admissible when every turn is.

Policy of the built-in processors (documented choice): an inadmissible *sample* is dropped on its own, with its
reason counted, before batches form (a grouped processor drops the whole group, see ``grouped.py``). Once a batch is
reserved it stays as it is; when the serving fence moved under it, the learner calls ``drop(batch_id, "stale")``,
which drops the whole batch, as upstream does. While a check is configured but the serving version is unknown
(``serving_version()`` returns ``None``), units wait: nothing can be shown admissible.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from reef_core.observe.compacted import is_compacted
from reef_core.observe.model import Record
from reef_core.observe.processor import ServingVersion
from reef_core.versions import on_line, parse_version

# Drop reasons shared by the built-in processors (status()["dropped"] counts them).
NO_REFERENCES = "no_references"  # a report quoting no receipt never trains
NO_SCORE = "no_score"  # a score is required and the report has none (or a non-finite one)
DUPLICATE = "duplicate"  # a receipt (or group slot) already held by a pending unit: the first report wins
ALREADY_CONSUMED = "already_consumed"  # a receipt that already trained
UNKNOWN_REFERENCE = "unknown_reference"  # a receipt the processor does not hold (evicted, or never ingested)
INCOMPLETE = "incomplete"  # record.complete is False, or the engine reported an error
NOT_CHAT = "not_chat"  # the inference is not a chat exchange (count_tokens, missing reply)
FILTERED = "filtered"  # the recipe's report filter refused it
STALE = "stale"  # more than max_staleness versions behind the serving version
CROSS_INCARNATION = "cross_incarnation"  # produced by another engine incarnation
FUTURE_VERSION = "future_version"  # produced by a version newer than the serving one
UNKNOWN_VERSION = "unknown_version"  # no version recorded, or an unparseable one different from serving
COMPACTED = "compacted"  # record retention dropped the body (expired or over budget) before it could train
CANARY_SERVED = "canary_served"  # served by a canary of a recipe that does not train on them (rollout.train_canary)

STALENESS_REASONS = (STALE, CROSS_INCARNATION, FUTURE_VERSION, UNKNOWN_VERSION)


def staleness_reason(producing: str | None, serving: str, max_staleness: int) -> str | None:
    """Why a turn produced by ``producing`` may not train while ``serving`` serves, or ``None`` if it may."""
    if producing is None:
        return UNKNOWN_VERSION
    try:
        made, now = parse_version(producing), parse_version(serving)
    except ValueError:
        return None if producing == serving else UNKNOWN_VERSION
    made = on_line(made, now)
    if made[0] != now[0]:
        return CROSS_INCARNATION
    lag = now[1] - made[1]
    if lag < 0:
        return FUTURE_VERSION
    if lag > max_staleness:
        return STALE
    return None


def check_max_staleness(value) -> int | None:
    """Validate a ``max_staleness`` setting (``None`` or a non-negative integer)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_staleness must be a non-negative integer or null, not {value!r}")
    return value


class StalenessPolicy:
    """``max_staleness`` plus the serving-version callable: decides whether a sample's turns may train."""

    def __init__(self, max_staleness: int | None, serving_version: ServingVersion | None):
        self.max_staleness = check_max_staleness(max_staleness)
        if self.max_staleness is not None and serving_version is None:
            raise ValueError("max_staleness needs a serving_version callable")
        self._serving = serving_version

    @property
    def enabled(self) -> bool:
        return self.max_staleness is not None

    def serving(self) -> str | None:
        """The currently serving version (``None`` when unknown or no callable was given)."""
        return self._serving() if self._serving is not None else None

    def reason(self, versions: Iterable[str | None], serving: str | None) -> str | None:
        """The first reason one of ``versions`` may not train under ``serving`` (``None``: all admissible).

        Call only when :attr:`enabled` and ``serving`` is known."""
        assert self.max_staleness is not None and serving is not None
        for version in versions:
            why = staleness_reason(version, serving, self.max_staleness)
            if why is not None:
                return why
        return None


def unusable_reason(record: Record) -> str | None:
    """Why an inference record can never train (incomplete or failed, served by a canary whose records do not train,
    not a chat), or ``None``."""
    if is_compacted(record):
        return COMPACTED
    if not record.complete or record.payload.get("error"):
        return INCOMPLETE
    rollout = record.payload.get("rollout")
    if isinstance(rollout, dict) and rollout.get("trains") is False:
        return CANARY_SERVED
    if record.payload.get("route", "chat") not in ("chat", "messages"):
        return NOT_CHAT
    return None


def report_score(record: Record) -> float | None:
    """A report's finite score, or ``None`` (missing, boolean, non-numeric or non-finite)."""
    score = record.payload.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return None
    score = float(score)
    return score if math.isfinite(score) else None
