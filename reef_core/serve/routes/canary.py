"""The canary of a scenario: its state (read), and an admin's promote or rollback of it.

What a canary is and how the rule decides are :mod:`reef_core.loop.rollout` and :mod:`reef_core.commit.canary`;
here are the door checks (the body's fields; ``action`` and ``reason`` are checked by the deployment before anything
is written) and who asked (the token's name, ``open`` when authentication is off).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from reef_core.serve.middleware.auth import ADMIN
from reef_core.serve.middleware.tenancy import principal_of
from reef_core.serve.routes.inference import admin_fields
from reef_core.serve.routes.names import path_scenario

router = APIRouter()
_NO_STORE = {"cache-control": "no-store"}
_FIELDS = {"action", "reason"}


@router.get("/reef/scenarios/{scenario}/canary")
async def canary_state(request: Request, scenario: str):
    """The scenario's rollout strategy; the running canary, its scored records and means by side and the rule's
    current answer; an A/B rollout's arms; the last canary decision in the chain."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    return JSONResponse(await asyncio.to_thread(dep.canary_state, found), headers=_NO_STORE)


@router.post("/reef/scenarios/{scenario}/canary", openapi_extra=ADMIN)
async def decide_canary(request: Request, scenario: str):
    """Promote the running canary (it becomes the head) or roll it back (the head republished, recording it), with
    the evidence so far; 409 when no canary runs."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    body = await admin_fields(request, dep, _FIELDS, "a canary decision takes action and reason")
    by = principal_of(request.scope).name
    decided = await asyncio.to_thread(dep.decide_canary, found, body.get("action"), body.get("reason"), by)
    return JSONResponse(decided, headers=_NO_STORE)
