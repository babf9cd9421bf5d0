"""``POST /reef/report``: feedback quoting receipts, validated at the door and stored as a record.

Validation (all before anything is stored or created): the scenario header; only the known top-level
fields; ``score`` a finite number and not a bool; ``feedback`` text or a JSON object within a size
cap; ``metadata.unscored`` (the unscored sentinel) a boolean, and when true the score null (an errored run is
never scored as a number); ``agent_record_id`` and each of ``references`` a record id (:mod:`reef_core.names`);
``references`` unique receipts of stored inference records of the same scenario (checked again
inside the write transaction); ``metadata`` an object; then the recipe's typed report schema, if
any, and the processor's door rule (:meth:`~reef_core.observe.processor.Processor.report_key`): a key
claimed in the write transaction, so a second, different report under a taken key is refused with 409
and stores nothing. The scenario is resolved without being created: a report that is stored creates it.
"""

from __future__ import annotations

import hashlib
import time
import uuid

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from reef_core.errors import Conflict
from reef_core.observe.model import Record, canonical_bytes
from reef_core.observe.reports import validate_report
from reef_core.serve.routes.inference import read_json_body
from reef_core.serve.routes.names import RECORD_ID_HEADER, scenario_header

router = APIRouter()


@router.post("/reef/report")
async def post_report(request: Request):
    dep = request.app.state.reef
    body = await read_json_body(request, dep.server.max_report_body_bytes)
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
    except Conflict as exc:
        if key is None or exc.details.get("idempotency_key") != key:
            raise
        raise Conflict(f"another report already holds {key!r} in scenario {scenario.name!r}",
                       param="metadata", key=key) from None
    return JSONResponse({"agent_record_id": stored.record_id, "scenario": scenario.name, "request_type": "report"},
                        headers={RECORD_ID_HEADER: stored.record_id})
