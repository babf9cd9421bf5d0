"""``POST /reef/train``: a person's instruction for a scenario, validated at the door and stored as a ``train``
record (rules: :mod:`reef_core.observe.instructions`).

Instructions never create a scenario: an unknown one is a 404 whatever ``server.allow_implicit_scenarios`` says. A
scenario whose recipe trains in ``auto`` mode refuses them (400 naming ``training_mode``). A refused instruction
stores nothing; an identical retry under the same ``agent_record_id`` returns the same receipt, another body under
it is a 409.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from reef_core.errors import NotFound, ValidationFailed
from reef_core.observe.instructions import check_training_mode, validate_instruction
from reef_core.observe.model import Record
from reef_core.serve.routes.inference import read_json_body
from reef_core.serve.routes.names import RECORD_ID_HEADER, SCENARIO_HEADER, scenario_header

router = APIRouter()

_REQUIREMENT = {"type": "object", "required": ["name", "kind", "prompt"], "properties": {
    "name": {"type": "string"}, "kind": {"enum": ["permission", "env", "service"]}, "check": {"type": "string"},
    "prompt": {"type": "string", "maxLength": 200}}}
#: The body as the OpenAPI document (and ``GET /docs``) shows it; the door itself is ``validate_instruction``.
BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["text"], "additionalProperties": False, "properties": {
        "text": {"type": "string", "minLength": 1, "maxLength": 4000,
                 "description": "the instruction; credential- or directive-shaped text is refused"},
        "session": {"type": "string"}, "release_id": {"type": "string", "description": "the release in use"},
        "requires": {"type": "array", "maxItems": 8, "items": _REQUIREMENT},
        "client": {"type": "object", "properties": {"platform": {"type": "string"}, "arch": {"type": "string"},
                                                    "release": {"type": "string"},
                                                    "commands": {"type": "array", "items": {"type": "string"}}}},
        "agent_record_id": {"type": "string", "description": "client-chosen receipt, for retry safety"}}}}}},
    "parameters": [{"name": SCENARIO_HEADER, "in": "header", "required": True, "schema": {"type": "string"}}]}


@router.post("/reef/train", openapi_extra=BODY)
async def post_instruction(request: Request):
    """Store an instruction for a ``manual`` or ``hybrid`` scenario; it stays pending until a commit consumes it."""
    dep = request.app.state.reef
    body = await read_json_body(request, dep.server.max_report_body_bytes)
    name = scenario_header(request)
    payload, record_id = validate_instruction(body)
    found = await asyncio.to_thread(dep.find_scenario, name)
    if found is None or found.archived:
        raise NotFound(f"unknown scenario {name!r} (instructions never create one)")
    scenario = await dep.resolve(name)
    mode = check_training_mode(dep.recipe(scenario).config.training_mode)
    if mode == "auto":
        raise ValidationFailed(f"training_mode: scenario {name!r} trains in auto mode (from traffic); instructions "
                               "need recipe.training_mode manual or hybrid", param="training_mode")
    record = Record(record_id=record_id or uuid.uuid4().hex, scenario=scenario.name, kind="train", payload=payload,
                    created_at=time.time())
    stored = await dep.record_stored(record)
    return JSONResponse({"agent_record_id": stored.record_id, "scenario": scenario.name, "request_type": "train",
                         "status_path": f"/reef/scenarios/{quote(scenario.name, safe='')}/status"},
                        headers={RECORD_ID_HEADER: stored.record_id})
