"""Read routes over scenarios and records (``/reef/scenarios...``)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse

from reef_core.observe.compacted import MARKER, compaction_of
from reef_core.serve.routes.compacted import compacted_error
from reef_core.observe.model import Record
from reef_core.serve.routes import export
from reef_core.serve.routes.names import path_record, path_scenario
from reef_core.serve.middleware.tenancy import visible

router = APIRouter()
router.include_router(export.router)  # GET /reef/scenarios/{s}/export: a read of the records, streamed
#: Bound of sequence and step query parameters: the stores hold them as signed 64-bit integers.
MAX_SEQUENCE = 2**63 - 1
_NO_STORE = {"cache-control": "no-store"}


def record_row(record: Record) -> dict:
    score = record.payload.get("score") if record.kind == "report" else None
    return {
        "sequence": record.sequence,
        "agent_record_id": record.record_id,
        "request_type": record.kind,
        "created_at": record.created_at,
        "references": list(record.references),
        "artifact_ref": record.version,
        "score": score,
        "complete": record.complete,
        "tags": dict(record.tags),
        # Retention dropped the bodies (``{"at", "reason", "body_bytes"}``), or null: the payload is whole.
        "compacted": compaction_of(record),
    }


@router.get("/reef/scenarios")
async def list_scenarios(request: Request):
    dep = request.app.state.reef
    rows = visible(request.scope, await asyncio.to_thread(dep.list_scenarios))
    return JSONResponse({"scenarios": [
        {"scenario": s.name, "recipe": s.recipe, "created_at": s.created_at, "archived": s.archived}
        for s in rows]}, headers=_NO_STORE)


@router.get("/reef/scenarios/{scenario}/records")
async def list_records(request: Request, scenario: str, after_sequence: int = Query(0, ge=0, le=MAX_SEQUENCE),
                       limit: int = Query(50, ge=1, le=100)):
    await path_scenario(request.app.state.reef, scenario, archived=True)
    rows = await asyncio.to_thread(request.app.state.reef.records_page, scenario, after_sequence, limit)
    next_after = rows[-1].sequence if len(rows) == limit else None
    return JSONResponse({"scenario": scenario, "records": [record_row(r) for r in rows],
                         "next_after_sequence": next_after}, headers=_NO_STORE)


@router.get("/reef/scenarios/{scenario}/records/{record_id}", responses={
    410: {"description": "record retention compacted the body (the error names when and why); its metadata stays "
                         "at .../metadata"}})
async def get_record(request: Request, scenario: str, record_id: str):
    record = await path_record(request.app.state.reef, scenario, record_id)
    marker = compaction_of(record)
    if marker is not None:
        raise compacted_error(record, marker)
    return JSONResponse({**record_row(record), "scenario": record.scenario, "payload": record.payload},
                        headers=_NO_STORE)


@router.get("/reef/scenarios/{scenario}/records/{record_id}/metadata")
async def get_record_metadata(request: Request, scenario: str, record_id: str):
    """A record without its bodies: 200 whether or not retention compacted it (``compacted`` says which), with
    what a compacted record keeps (usage, token counts, route, timings...) under ``kept``."""
    record = await path_record(request.app.state.reef, scenario, record_id)
    kept = {k: v for k, v in record.payload.items() if k != MARKER} if compaction_of(record) is not None else None
    return JSONResponse({**record_row(record), "scenario": record.scenario, "content_hash": record.content_hash,
                         "kept": kept}, headers=_NO_STORE)

