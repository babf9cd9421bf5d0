"""The ``ttt`` report schema: one scored rollout of the grid, with the state it produced.

``{"score": finite number, "references": [one receipt], "metadata": {"step", "group", "rollout", "state"}}``. The
grid barrier checks the coordinates at the door (400 naming the field, 409 for a slot reported twice, 400 for any
step but the open one); this schema checks what the barrier does not: the score, a single receipt, and that
``metadata.state`` is given (``null`` for a rollout that produced nothing, e.g. malformed guidance).
"""

from __future__ import annotations

import math
from typing import Any

from reef_core.api import ValidationFailed


def validate_ttt_report(report: dict) -> dict:
    score: Any = report.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(float(score)):
        raise ValidationFailed("ttt: a report needs a finite numeric score (the verifier's score of the rollout)",
                               param="score")
    refs = report.get("references")
    if not isinstance(refs, list) or len(refs) != 1:
        raise ValidationFailed("ttt: a report quotes exactly one receipt (the rollout's inference)",
                               param="references")
    metadata = report.get("metadata")
    if not isinstance(metadata, dict) or "state" not in metadata:
        raise ValidationFailed("ttt: metadata.state is required (the new state, text or JSON; null for none)",
                               param="metadata.state")
    return report


def make_ttt_report_schema(**_context) -> Any:
    return validate_ttt_report
