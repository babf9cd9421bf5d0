"""The ``sao`` report schema: one scored rollout per report.

SAO learns from a stream of single rollouts, each with its own verifier score, so a report must carry a finite
numeric ``score`` and quote exactly one receipt (the inference it scores). Anything else is refused at the door of
``POST /reef/report`` with a 400 naming the problem.
"""

from __future__ import annotations

import math
from typing import Any

from reef_core.api import ValidationFailed


def validate_sao_report(report: dict) -> dict:
    """Return ``report`` unchanged if it fits, else raise :class:`ValidationFailed`."""
    if not isinstance(report, dict):
        raise ValidationFailed("sao: a report must be a JSON object")
    score: Any = report.get("score")
    if score is None:
        raise ValidationFailed("sao: a report needs a numeric 'score' (the verifier's score of the rollout)")
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise ValidationFailed(f"sao: 'score' must be a number, got {type(score).__name__}")
    if not math.isfinite(float(score)):
        raise ValidationFailed("sao: 'score' must be finite (no NaN or infinity)")
    refs = report.get("references")
    if not isinstance(refs, list) or len(refs) != 1:
        count = len(refs) if isinstance(refs, list) else 0
        raise ValidationFailed(f"sao: a report must quote exactly one receipt in 'references' (got {count}); "
                               "SAO scores single rollouts, one report per rollout")
    if not isinstance(refs[0], str) or not refs[0]:
        raise ValidationFailed("sao: the reference must be a non-empty receipt id (agent_record_id)")
    return report


def make_sao_report_schema(**_context) -> Any:
    """Report-schema factory: returns the validator."""
    return validate_sao_report
