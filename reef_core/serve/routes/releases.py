"""Release, commit-log, evaluation and status routes of a scenario.

Reads (release list, commit log, status) need an inference token; operations that change what
a scenario serves (rollback, promote, delete) are marked admin and need an admin token.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse

from reef_core.errors import ValidationFailed
from reef_core.serve.routes.inference import read_json_body
from reef_core.serve.routes.names import path_scenario
from reef_core.serve.routes.reads import MAX_SEQUENCE
from reef_core.serve.middleware.tenancy import principal_of
from reef_core.serve.middleware.auth import ADMIN

router = APIRouter()
_NO_STORE = {"cache-control": "no-store"}


async def _scenario(request: Request, name: str):
    dep = request.app.state.reef
    return dep, await path_scenario(dep, name)


async def _release_id(request: Request) -> str:
    body = await read_json_body(request, request.app.state.reef.server.max_admin_body_bytes)
    unknown = sorted(set(body) - {"release_id"})
    if unknown:
        raise ValidationFailed(f"unknown field(s): {', '.join(unknown)}")
    release_id = body.get("release_id")
    if not isinstance(release_id, str) or not release_id:
        raise ValidationFailed("release_id must be a non-empty string")
    return release_id


@router.get("/reef/scenarios/{scenario}/releases")
async def list_releases(request: Request, scenario: str):
    dep, found = await _scenario(request, scenario)
    rows = await asyncio.to_thread(dep.release_rows, found.name)
    return JSONResponse({"scenario": found.name, "releases": rows}, headers=_NO_STORE)


@router.get("/reef/scenarios/{scenario}/evaluations")
async def list_evaluations(request: Request, scenario: str, limit: int = Query(10, ge=1, le=100)):
    """The scenario's ``reef eval releases`` runs, newest first: scores per release and task set, and forgetting."""
    dep, found = await _scenario(request, scenario)
    runs = await asyncio.to_thread(dep.evaluation_runs, found.name, limit)
    runs = [{k: v for k, v in run.items() if k != "path"} for run in runs]  # the server's own file path stays private
    return JSONResponse({"scenario": found.name, "evaluations": runs}, headers=_NO_STORE)


_RELEASE_QUERY = {"min_length": 1, "max_length": 200}


@router.get("/reef/scenarios/{scenario}/releases/compare")
async def compare_releases(request: Request, scenario: str,
                           a: str = Query(..., description="release id (or alias) of the baseline", **_RELEASE_QUERY),
                           b: str = Query(..., description="release id (or alias) compared with a", **_RELEASE_QUERY)):
    """Scored records, mean reported score of releases a and b, and a bootstrap interval of b - a (unpaired),
    from the scenario's production reports grouped by the release that served each record."""
    dep, found = await _scenario(request, scenario)
    return JSONResponse(await asyncio.to_thread(dep.compare_releases, found, a, b), headers=_NO_STORE)


async def _republish(request: Request, scenario: str, operation: str) -> dict:
    dep, found = await _scenario(request, scenario)
    release_id = await _release_id(request)
    note = {"by": principal_of(request.scope).name}  # who moved the head, in the new release's source
    release = await asyncio.to_thread(dep.republish, found, operation, release_id, note)
    return {"scenario": found.name, "release_id": release.release_id, "content_id": release.content_id}


@router.post("/reef/scenarios/{scenario}/rollback", openapi_extra=ADMIN)
async def rollback(request: Request, scenario: str):
    """Serve an earlier release again, published as a new release (history is only appended)."""
    return await _republish(request, scenario, "rollback")


@router.post("/reef/scenarios/{scenario}/promote", openapi_extra=ADMIN)
async def promote(request: Request, scenario: str):
    """Serve a release held for review (``evaluation.publish=review``)."""
    return await _republish(request, scenario, "promote")


@router.delete("/reef/scenarios/{scenario}", openapi_extra=ADMIN)
async def delete_scenario(request: Request, scenario: str):
    dep, found = await _scenario(request, scenario)
    await asyncio.to_thread(dep.archive_scenario, found.name)
    return {"scenario": found.name, "archived": True}


@router.get("/reef/scenarios/{scenario}/commits")
async def list_commits(request: Request, scenario: str, after_step: int = Query(0, ge=0, le=MAX_SEQUENCE),
                       limit: int = Query(50, ge=1, le=100), record_id: list[str] = Query(default=[])):
    dep, found = await _scenario(request, scenario)
    if len(record_id) > 100:
        raise ValidationFailed("at most 100 record_id filters")
    rows = await asyncio.to_thread(dep.commit_rows, found, after_step, limit, record_id or None)
    next_after = rows[-1]["step"] if len(rows) == limit else None
    return JSONResponse({"scenario": found.name, "commits": rows, "next_after_step": next_after},
                        headers=_NO_STORE)


@router.get("/reef/scenarios/{scenario}/status")
async def scenario_status(request: Request, scenario: str):
    dep, found = await _scenario(request, scenario)
    return JSONResponse(await asyncio.to_thread(dep.scenario_status, found), headers=_NO_STORE)


@router.get("/reef/scenarios/{scenario}/samples")
async def preview_samples(request: Request, scenario: str, limit: int = Query(20, ge=1, le=100)):
    """What the processor would train on next (nothing is reserved or consumed)."""
    dep, found = await _scenario(request, scenario)
    samples = await asyncio.to_thread(dep.preview_samples, found, limit)
    rows = [{"messages": s.messages, "reward": s.reward, "feedback": s.feedback, "metadata": s.metadata,
             "source_ids": s.source_ids, "report_id": s.report_id, "versions": s.versions,
             "turns": len(s.segments), "group_key": s.group_key} for s in samples]
    return JSONResponse({"scenario": found.name, "samples": rows}, headers=_NO_STORE)


@router.get("/reef/status")
async def deployment_status(request: Request):
    """The deployment's status, limited to the token's scenarios; an admin token also sees per-token usage (every
    token's for an all-scenario admin, its own for a confined one)."""
    dep = request.app.state.reef
    status = await asyncio.to_thread(dep.status)
    principal = principal_of(request.scope)
    if not principal.all_scenarios:
        for key in ("scenarios", "quarantined"):
            if isinstance(status.get(key), dict):
                status[key] = {name: value for name, value in status[key].items() if principal.allows(name)}
    if "admin" in principal.scopes and request.app.state.reef_tokens.enabled:
        status["usage"] = request.app.state.reef_usage.snapshot(None if principal.all_scenarios else {principal.name})
    return JSONResponse(status, headers=_NO_STORE)
