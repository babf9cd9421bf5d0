"""Harness routes: clients pull the text tree of a scenario's release.

``GET /reef/harness`` (header ``x-reef-scenario``)
    ``{release_id, content_id, parent_release_id, files: {path: text}, evaluation, gate, requires}`` of
    the release now serving the scenario, plus ``x-reef-release-id``. ``?release_id=`` (alias
    ``?version=``) reads an earlier restorable release of the same scenario; ``?path=`` narrows
    ``files`` to one file.
``GET /reef/harness/files/{path}``
    One file of the serving (or ``?release_id=``) release as ``text/plain``.
``GET /reef/harness/releases``
    ``{scenario, releases}``, oldest first, each row with its 0-based ``step`` and manifest metrics.

Every route is read-only: it never creates a scenario (but for ``GET /reef/harness/install``, which creates one its
first inference request would create from a seed release: :func:`harness_surface`). 404 when the scenario is unknown, its recipe
serves no files (no harness surface), or the release is unknown, foreign or not restorable. A
requested path is validated (400 for traversal, absolute paths, backslashes, encoded separators...)
and then only looked up among the release's own files, which come from git objects or memory:
nothing outside the artifact is ever opened.

Asks the deployment (``ServePorts``) for the scenario (``find_scenario``), its surface (``surface_for``) and the
release (``find_release``, ``release_files``, ``release_rows``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, PlainTextResponse

from reef_core.errors import Conflict, NotFound, ValidationFailed
from reef_core.surfaces.harness import RELEASE_HEADER, validate_harness_path
from reef_core.serve.routes.names import scenario_header
from reef_core.serve.middleware.tenancy import check_scenario, principal_of

router = APIRouter()
_NO_STORE = {"cache-control": "no-store"}


async def harness_surface(request: Request, name: str | None = None, *,
                          create_seed: bool = False) -> tuple[Any, str, Any]:
    """(deployment, scenario name, harness surface) for the request (or scenario ``name``), or NotFound.

    ``create_seed`` (the install route): a scenario not stored yet whose recipe serves a seed release (a harness
    trainer's creation files) is created as its first inference request would create it, by a token that may
    infer on it and only where implicit scenarios are on, so that its harness can be installed before that
    request (issue #37)."""
    dep = request.app.state.reef
    name = name or scenario_header(request)
    check_scenario(request.scope, name)
    scenario = await asyncio.to_thread(dep.find_scenario, name)
    if scenario is None and create_seed and "infer" in principal_of(request.scope).scopes:
        candidate = await dep.resolve(name)  # NotFound when implicit scenarios are off
        if dep.serves_a_seed(candidate):
            scenario = await dep.create_scenario(name)
    if scenario is None or getattr(scenario, "archived", False):
        raise NotFound(f"unknown scenario {name!r}")
    surface = dep.surface_for(scenario)
    if surface is None or getattr(surface, "kind", None) != "harness":
        raise NotFound(f"the recipe of scenario {name!r} serves no harness files")
    return dep, name, surface


def _requested_release(request: Request) -> str | None:
    params = request.query_params
    release_id = params.get("release_id")
    # ``?version=`` is the legacy name older clients send (upstream-reef.md); in Reef a version is what
    # an engine serves, and a release in the chain is a release_id.
    version = params.get("version")
    if release_id and version and release_id != version:
        raise ValidationFailed("release_id and version name different releases")
    return release_id or version or None


def _checked_path(path: str | None) -> str | None:
    if path is None:
        return None
    return validate_harness_path(path)


def read_release(dep, surface, scenario: str, release_id: str | None) -> tuple[Any, dict[str, str]]:
    """The release (manifest) and its files as text: the serving one, or ``release_id`` of this scenario."""
    if release_id is None:
        served = surface.current(scenario)
        if served is None or served.release_id is None:
            # The chain's head is committed before this process activates it: a client that saw it current in the
            # releases list reads it from the store meanwhile.
            head = next((r.get("release_id") for r in dep.release_rows(scenario) if r.get("current")), None)
            if head is None:
                raise NotFound(f"scenario {scenario!r} has no harness release yet")
            return read_release(dep, surface, scenario, head)
        release_id = served.release_id
        files = dict(served.files)
        try:
            release = dep.find_release(release_id)
        except NotFound:  # a live (not durable) release: served from memory only
            release = None
        return _Row.of(release, release_id), files
    release = dep.find_release(release_id)  # NotFound for unknown / malformed ids
    if release.scenario != scenario:
        raise NotFound(f"release {release.release_id} is not a release of scenario {scenario!r}")
    if not release.restorable:
        raise NotFound(f"release {release.release_id} is not restorable")
    try:
        raw = dep.release_files(release.release_id)
    except Conflict:
        raise NotFound(f"release {release.release_id} is not restorable") from None
    return _Row.of(release, release.release_id), surface.checked(raw)


class _Row:
    """The manifest fields the harness response carries."""

    def __init__(self, release_id: str, content_id, parent, evaluation):
        self.release_id = release_id
        self.content_id = content_id
        self.parent_release_id = parent
        self.evaluation = evaluation

    @classmethod
    def of(cls, release, release_id: str) -> "_Row":
        if release is None:
            return cls(release_id, None, None, None)
        return cls(release.release_id, release.content_id, release.parent_release_id, release.evaluation)


@router.get("/reef/harness")
async def get_harness(request: Request):
    path = _checked_path(request.query_params.get("path"))
    dep, scenario, surface = await harness_surface(request)
    row, files = await asyncio.to_thread(read_release, dep, surface, scenario, _requested_release(request))
    if path is not None:
        if path not in files:
            raise NotFound(f"release {row.release_id} has no file {path!r}")
        files = {path: files[path]}
    body = {
        "scenario": scenario,
        "release_id": row.release_id,
        "content_id": row.content_id,
        "parent_release_id": row.parent_release_id,
        "files": files,
        "evaluation": row.evaluation,
        "gate": row.evaluation,
        "requires": [],
    }
    return JSONResponse(body, headers={RELEASE_HEADER: row.release_id, **_NO_STORE})


@router.get("/reef/harness/files/{path:path}")
async def get_harness_file(request: Request, path: str):
    path = validate_harness_path(path)
    dep, scenario, surface = await harness_surface(request)
    row, files = await asyncio.to_thread(read_release, dep, surface, scenario, _requested_release(request))
    if path not in files:
        raise NotFound(f"release {row.release_id} has no file {path!r}")
    return PlainTextResponse(files[path], headers={RELEASE_HEADER: row.release_id, **_NO_STORE})


def _release_rows(dep, scenario: str) -> list[dict]:
    """The scenario's releases, oldest first, each with its catalog ``step`` (the deployment's rows: manifest
    metrics plus publish latency, ``current`` as the learner sees it)."""
    rows = [dict(r) for r in dep.release_rows(scenario)]
    rows.reverse()  # listed newest first
    for step, row in enumerate(rows):
        row["step"] = step
    return rows


@router.get("/reef/harness/releases")
async def list_harness_releases(request: Request):
    dep, scenario, _surface = await harness_surface(request)
    rows = await asyncio.to_thread(_release_rows, dep, scenario)
    return JSONResponse({"scenario": scenario, "releases": rows}, headers=_NO_STORE)
