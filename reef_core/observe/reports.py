"""A report's generic rules: the fields a report may carry and their checks, before anything is stored.

Shared by the report route (``POST /reef/report``, :mod:`reef_core.serve.routes.reports`), the record import and the offline
loop (:mod:`reef_core.loop.offline`), so a report is the same thing whichever way it arrives: only the known
top-level fields; ``score`` a finite number and not a bool; ``feedback`` text or a JSON object within a size cap;
``metadata`` an object, ``metadata.unscored`` (the unscored sentinel) a boolean, and when true the score null;
``agent_record_id`` and each of ``references`` a record id (:mod:`reef_core.names`), the references unique.
"""

from __future__ import annotations

import json
import math

from ..errors import ValidationFailed
from ..names import check_record_id

REPORT_FIELDS = frozenset({"score", "feedback", "references", "metadata", "agent_record_id"})
MAX_REFERENCES = 100
MAX_FEEDBACK_BYTES = 64 * 1024
MAX_METADATA_BYTES = 64 * 1024


def _finite(number: int | float) -> bool:
    """Whether ``number`` is finite as a float (processors compute with scores as floats; 10**400 is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def validate_report(body: dict) -> dict:
    """Check the generic report rules; return the normalised report."""
    unknown = sorted(set(body) - REPORT_FIELDS)
    if unknown:
        raise ValidationFailed(f"unknown report field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(REPORT_FIELDS))}")
    report: dict = {}
    if "score" in body and body["score"] is not None:
        score = body["score"]
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not _finite(score):
            raise ValidationFailed("score must be a finite number", param="score")
        report["score"] = score
    if "feedback" in body and body["feedback"] is not None:
        feedback = body["feedback"]
        if not isinstance(feedback, (str, dict)):
            raise ValidationFailed("feedback must be text or a JSON object")
        if len(json.dumps(feedback).encode()) > MAX_FEEDBACK_BYTES:
            raise ValidationFailed(f"feedback is larger than {MAX_FEEDBACK_BYTES} bytes")
        report["feedback"] = feedback
    references = body.get("references") or []
    if not isinstance(references, list):
        raise ValidationFailed("references must be a list of receipts", field="references")
    for i, ref in enumerate(references):
        check_record_id(ref, f"references[{i}]")
    if len(references) > MAX_REFERENCES:
        raise ValidationFailed(f"at most {MAX_REFERENCES} references per report")
    duplicates = sorted({r for r in references if references.count(r) > 1})
    if duplicates:
        raise ValidationFailed(f"duplicate reference {duplicates[0]!r}")
    report["references"] = references
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise ValidationFailed("metadata must be a JSON object")
        if isinstance(metadata.get("training"), dict) and "eligible" in metadata["training"]:
            raise ValidationFailed("metadata.training.eligible is not supported: eligibility is the recipe's decision")
        if len(json.dumps(metadata).encode()) > MAX_METADATA_BYTES:
            raise ValidationFailed(f"metadata is larger than {MAX_METADATA_BYTES} bytes")
        # The unscored sentinel: a graded run that could not be scored (the task errored) says so explicitly,
        # with no number, so nothing averages it as a score (never a fake 0 or -1).
        unscored = metadata.get("unscored")
        if unscored is not None and not isinstance(unscored, bool):
            raise ValidationFailed("metadata.unscored must be true or false", param="metadata")
        if unscored and "score" in report:
            raise ValidationFailed("an unscored report (metadata.unscored: true) carries score null", param="score")
        report["metadata"] = metadata
    record_id = body.get("agent_record_id")
    if record_id is not None:
        check_record_id(record_id, "agent_record_id")
    report["agent_record_id"] = record_id
    return report
