"""The ``skillclaw`` report schema: one report per graded session, checked at the door of ``POST /reef/report``.

A report quotes every receipt of its session (``references``, at least one), names ``metadata.task`` and
``metadata.category`` (non-empty text), and carries either a score in [0, 1] or the unscored sentinel
(``score: null`` with ``metadata.unscored: true``) for a run that errored: never a made-up number.
"""

from __future__ import annotations

from reef_core.api import ValidationFailed

MAX_NAME_CHARS = 200


def validate_report(report: dict) -> dict:
    if not report.get("references"):
        raise ValidationFailed("a SkillClaw report quotes every receipt of its session (references is empty)",
                               field="references")
    metadata = report.get("metadata") or {}
    for key in ("task", "category"):
        value = metadata.get(key)
        if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_CHARS:
            raise ValidationFailed(f"metadata.{key} must be non-empty text of at most {MAX_NAME_CHARS} characters",
                                   param="metadata")
    unscored = metadata.get("unscored") is True
    if "score" not in report:
        if not unscored:
            raise ValidationFailed("score is missing: report a number in [0, 1], or score null with "
                                   "metadata.unscored: true for a run that errored", param="score")
    elif not 0 <= report["score"] <= 1:
        raise ValidationFailed("score must be in [0, 1]", param="score")
    return report


def make_report_schema(**_ignored):
    return validate_report
