"""``POST /reef/report``: feedback quoting receipts, validated at the door and stored as a record.

Validation (all before anything is stored or created): the scenario header; only the known top-level
fields; ``score`` a finite number and not a bool; ``feedback`` text or a JSON object within a size
cap; ``metadata.unscored`` (the unscored sentinel) a boolean, and when true the score null (an errored run is
never scored as a number); ``agent_record_id`` and each of ``references`` a record id (:mod:`reef_core.observe.names`);
``references`` unique receipts of stored inference records of the same scenario (checked again
inside the write transaction); ``metadata`` an object; then the recipe's typed report schema, if
any, and the processor's door rule (:meth:`~reef_core.observe.processor.Processor.report_key`): a key
claimed in the write transaction, so a second, different report under a taken key is refused with 409
and stores nothing. The scenario is resolved without being created: a report that is stored creates it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from ..errors import Conflict, ValidationFailed
from ..observe.model import Record, canonical_bytes
from ..observe.names import check_record_id
from .inference import read_json_body
from .names import RECEIPT_HEADER, scenario_header
from .tenancy import confined_reference

router = APIRouter()

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


@router.post("/reef/report")
async def post_report(request: Request):
    dep = request.app.state.reef
    body = await read_json_body(request, dep.cfg.server.max_report_body_bytes)
    name = scenario_header(request)
    report = validate_report(body)
    scenario = await dep.resolve(name)  # creates nothing: storing the report does
    schema = dep.report_schema(scenario)
    if schema is not None:
        schema(dict(report))  # raises ValidationFailed with the recipe's own message
    # The processor's own door rule (e.g. one report per grid slot): the key is claimed in the write transaction.
    key = dep.report_key(scenario, dict(report))
    record = Record(
        record_id=report["agent_record_id"] or uuid.uuid4().hex,
        scenario=scenario.name,
        kind="report",
        payload={k: report[k] for k in ("score", "feedback", "metadata") if k in report},
        references=report["references"],
        version=None,
        created_at=time.time(),
        # Under a key, resending this very report is a retry (answered with the stored one); any other is a 409.
        request_hash=hashlib.sha256(canonical_bytes(report)).hexdigest() if key is not None else None,
    )
    try:
        stored = await dep.record_stored(record, key, check_references=True)
    except ValidationFailed as exc:
        raise confined_reference(request.scope, exc) from None
    except Conflict as exc:
        if key is None or exc.details.get("idempotency_key") != key:
            raise
        raise Conflict(f"another report already holds {key!r} in scenario {scenario.name!r}",
                       param="metadata", key=key) from None
    return JSONResponse({"agent_record_id": stored.record_id, "scenario": scenario.name, "request_type": "report"},
                        headers={RECEIPT_HEADER: stored.record_id})
