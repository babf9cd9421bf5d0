"""Recipe routes under a scenario: ``GET /reef/scenarios/{scenario}/<recipe>/<path>``.

Plugins register them through ``reef_register_scenario_routes`` (see :mod:`reef_core.hookspecs`); each becomes one
concrete route here, so ``/openapi.json`` lists it and the fuzz test covers it. The door is the core's, as for every
scenario route: the path's scenario is checked (400 for a name the rule refuses, 404 for an archived one, created
never), then its recipe (404 when the scenario runs another recipe), then the handler runs on a worker thread with a
:class:`~reef_core.loop.ports.ScenarioView` and the query parameters. A name no record has created yet is answered
from config (a view with no processor, trainer or release: ``Deployment.provisional_view``) when its first record
would bind it to the route's recipe, so a client can ask a recipe what to do before its first request; otherwise it
is a 404. A handler's ``ReefError`` is
answered in Reef's error shape; anything else is a 500 with an error id.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Callable

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from reef_core.errors import NotFound
from reef_core.serve.routes.names import path_scenario

log = logging.getLogger("reef.serve")

#: ``<recipe>/<path>``: lower-case segments of letters, digits, ``-`` and ``_``.
ROUTE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*(/[a-z0-9][a-z0-9_-]*)+")
_NO_STORE = {"cache-control": "no-store"}


def mount(app: FastAPI, plugin_manager: Any) -> None:
    """Add one ``GET`` route per registered scenario route (none without a plugin manager)."""
    if plugin_manager is None:
        return
    for name, component in sorted(plugin_manager.components.get("scenario_route", {}).items()):
        if not ROUTE_NAME.fullmatch(name):
            log.error("plugin %s registered the scenario route %r, which is not <recipe>/<path> in lower-case "
                      "letters, digits, '-' and '_'; not served", component.plugin, name)
            continue
        app.add_api_route(f"/reef/scenarios/{{scenario}}/{name}", _endpoint(name, component.factory),
                          methods=["GET"], name=f"scenario_route:{name}",
                          description=component.description or None)


def _endpoint(name: str, handler: Callable[..., Any]):
    recipe = name.split("/", 1)[0]

    async def endpoint(request: Request, scenario: str):
        dep = request.app.state.reef
        try:
            found = await path_scenario(dep, scenario)
        except NotFound:
            # A name no record has created yet: answered from config when its first record would bind it here.
            view = await asyncio.to_thread(dep.provisional_view, scenario)
            if view is None or view.recipe.name != recipe:
                raise
        else:
            if found.recipe != recipe:
                raise NotFound(f"scenario {scenario!r} runs recipe {found.recipe!r}; {name!r} is a route of recipe "
                               f"{recipe!r}")
            view = await asyncio.to_thread(dep.scenario_view, found)
        body = await asyncio.to_thread(handler, view, dict(request.query_params))
        return JSONResponse(body, headers=_NO_STORE)

    return endpoint
