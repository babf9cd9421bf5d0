"""Skill routes: agents read the shared skill pool of a scenario; an operator closes a day.

``GET /reef/skills`` (header ``x-reef-scenario``)
    ``{scenario, release_id, skills: [{slug, name, description, category, path}], catalog}``: the serving pool's
    catalog (``catalog``: the exact text injected into requests).
``GET /reef/skills/{slug}``
    ``{scenario, release_id, slug, name, description, category, path, body, text}`` of one skill (``text``: the
    whole SKILL.md), with ``x-reef-release-id``. The slug is checked first (400 for anything but a lowercase
    slug); 404 for an unknown scenario, a recipe without the skills surface, no pool yet, or an unknown skill.
``POST /reef/scenarios/{scenario}/skills/close-day`` (admin)
    Closes the day's batch now: every report stored before this call goes into one batch even when fewer than
    ``batch_size`` sessions were graded (:meth:`PerReportProcessor.close_batch`). ``{scenario, closed_through,
    waiting}``; 409 when the scenario's processor cannot close a batch early.

Read routes never create a scenario; the whole tree is also served by ``GET /reef/harness``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from reef_core.errors import NotFound, ValidationFailed
from reef_core.surfaces.harness import RELEASE_HEADER
from reef_core.surfaces.skills import render_skill, validate_slug
from reef_core.serve.routes.inference import read_json_body
from reef_core.serve.routes.names import path_scenario, scenario_header
from reef_core.serve.middleware.auth import ADMIN

router = APIRouter()
_NO_STORE = {"cache-control": "no-store"}


async def _skill_surface(request: Request) -> tuple[str, Any]:
    """(scenario name, skills surface) for the request, or NotFound."""
    dep = request.app.state.reef
    name = scenario_header(request)
    scenario = await asyncio.to_thread(dep.find_scenario, name)
    if scenario is None or getattr(scenario, "archived", False):
        raise NotFound(f"unknown scenario {name!r}")
    surface = dep.surface_for(scenario)
    if surface is None or not getattr(surface, "serves_skills", False):
        raise NotFound(f"the recipe of scenario {name!r} serves no skill pool")
    return name, surface


def _pool(surface, scenario: str):
    found = surface.served_pool(scenario)
    if found is None or found[0] is None:
        raise NotFound(f"scenario {scenario!r} has no skill release yet")
    return found


@router.get("/reef/skills")
async def list_skills(request: Request):
    scenario, surface = await _skill_surface(request)
    release_id, skills, catalog = await asyncio.to_thread(_pool, surface, scenario)
    body = {"scenario": scenario, "release_id": release_id,
            "skills": [s.to_dict() for s in skills.values()], "catalog": catalog}
    return JSONResponse(body, headers={RELEASE_HEADER: release_id, **_NO_STORE})


@router.get("/reef/skills/{slug}")
async def get_skill(request: Request, slug: str):
    slug = validate_slug(slug)  # at the door: nothing is looked up for a malformed slug
    scenario, surface = await _skill_surface(request)
    release_id, skills, _catalog = await asyncio.to_thread(_pool, surface, scenario)
    skill = skills.get(slug)
    if skill is None:
        raise NotFound(f"release {release_id} of scenario {scenario!r} has no skill {slug!r}")
    body = {"scenario": scenario, "release_id": release_id, **skill.to_dict(), "body": skill.body,
            "text": render_skill(skill)}
    return JSONResponse(body, headers={RELEASE_HEADER: release_id, **_NO_STORE})


@router.post("/reef/scenarios/{scenario}/skills/close-day", openapi_extra=ADMIN)
async def close_day(request: Request, scenario: str):
    dep = request.app.state.reef
    body = await read_json_body(request, dep.server.max_admin_body_bytes) if await _has_body(request) else {}
    if body:
        raise ValidationFailed(f"close-day takes no fields; got {', '.join(sorted(body))}")
    found = await path_scenario(dep, scenario)
    surface = dep.surface_for(found)
    if surface is None or not getattr(surface, "serves_skills", False):
        raise NotFound(f"the recipe of scenario {found.name!r} serves no skill pool")
    through, waiting = await asyncio.to_thread(dep.close_batch, found)
    return JSONResponse({"scenario": found.name, "closed_through": through, "waiting": waiting}, headers=_NO_STORE)


async def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return bool(request.headers.get("transfer-encoding")) or (length is not None and length.strip() not in ("", "0"))
