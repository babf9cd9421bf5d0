"""Alias routes of a scenario: list them, move one (admin), read one's audited moves.

What an alias is, and why ``production`` moves by rollback, is :mod:`reef_core.loop.aliases`; here are the door
checks (the body's shape; the name, release and reason are checked by the deployment before anything is written)
and who asked (the token's name, ``open`` when authentication is off).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse

from reef_core.serve.middleware.auth import ADMIN
from reef_core.serve.middleware.tenancy import principal_of
from reef_core.serve.routes.inference import admin_fields
from reef_core.serve.routes.names import path_scenario

router = APIRouter()
_NO_STORE = {"cache-control": "no-store"}
_FIELDS = {"release", "reason"}


@router.get("/reef/scenarios/{scenario}/aliases")
async def list_aliases(request: Request, scenario: str):
    """``production`` (the release serving now) and every other alias, each with its last move."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    return JSONResponse(await asyncio.to_thread(dep.list_aliases, found), headers=_NO_STORE)


@router.put("/reef/scenarios/{scenario}/aliases/{name}", openapi_extra=ADMIN)
async def move_alias(request: Request, scenario: str, name: str):
    """Point an alias at a release of the scenario, recording who, when, from which release and why; moving
    ``production`` serves the release (a rollback, or a promote of a release held for review)."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    body = await admin_fields(request, dep, _FIELDS, "an alias move takes release and reason")
    by = principal_of(request.scope).name
    moved = await asyncio.to_thread(dep.move_alias, found, name, body.get("release"), body.get("reason"), by)
    return JSONResponse(moved, headers=_NO_STORE)


@router.get("/reef/scenarios/{scenario}/aliases/{name}/history")
async def alias_history(request: Request, scenario: str, name: str, limit: int = Query(50, ge=1, le=500)):
    """The alias's moves, newest first (``production``'s are the release chain's head moves)."""
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario)
    return JSONResponse(await asyncio.to_thread(dep.alias_history, found, name, limit), headers=_NO_STORE)
