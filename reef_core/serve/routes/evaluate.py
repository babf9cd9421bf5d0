"""``POST /reef/scenarios/{s}/evaluate`` (admin or the ``eval`` scope): one chat answered by a named release, or the
scenario's candidate held for review, on the deployment's private engine, recording and training nothing.

Here are the door checks (the scenario, the body's shape: :func:`reef_core.serve.schema.validate_evaluate`) and the
answer; which release the name means, what the private engine can serve and its busy limit are the loop's
(:mod:`reef_core.loop.evaluate`). A refused request stores and creates nothing: the scenario must exist already.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from reef_core.serve.middleware.auth import EVAL
from reef_core.serve.routes.inference import read_json_body
from reef_core.serve.routes.names import path_scenario
from reef_core.serve.schema import validate_evaluate
from reef_core.wire import RELEASE_HEADER

router = APIRouter()


@router.post("/reef/scenarios/{scenario}/evaluate", openapi_extra=EVAL)
async def evaluate(request: Request, scenario: str):
    """An OpenAI chat completion of ``messages`` by the release ``release`` names (a release id, an alias or
    ``candidate``), plus ``reef`` (which release answered; ``recorded: false``) and the ``x-reef-release-id``
    header; no record, no receipt."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    body = await read_json_body(request, dep.server.max_body_bytes)
    validate_evaluate(body)
    options = {key: body.get(key) for key in ("max_tokens", "temperature", "seed")}
    answer = await dep.evaluate(found, body["release"], body["messages"], options)
    return JSONResponse(answer, headers={RELEASE_HEADER: answer["reef"]["release_id"], "cache-control": "no-store"})
