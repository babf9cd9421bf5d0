"""``GET /reef/harness/install?adapter=<name>[&release_id=][&scenario=]``: the install script of a harness release.

Answers ``text/x-shellscript`` (:mod:`reef_core.serve.routes.install_script`) installing the scenario's serving release
(or ``release_id``), rendered by the registered harness adapter ``adapter`` (``reef_register_harness_adapters``)
and bound to the address the client reached (``x-forwarded-proto`` / ``x-forwarded-host`` honoured). The scenario
comes from ``x-reef-scenario`` or, for ``curl ... | sh`` convenience, ``?scenario=`` (both given must agree). A
scenario with no record yet whose recipe serves a seed (creation) release is created here, as its first inference
request would create it (a token with the ``infer`` scope, implicit scenarios on), so the harness installs before that
request; any other unknown scenario is 404, never created. Query parameters are checked at the door: an
unknown, repeated or empty one, or an unknown adapter, is 400 naming it.
"""

from __future__ import annotations

import asyncio
import re

from fastapi import APIRouter, Request
from starlette.responses import Response

from reef_core.errors import UnknownComponent, ValidationFailed
from reef_core.names import check_scenario_name, header_text
from reef_core.surfaces.adapters import ModelBinding
from reef_core.serve.routes.harness import harness_surface, read_release
from reef_core.serve.routes.install_script import render_install_script
from reef_core.serve.routes.names import SCENARIO_HEADER, single_header
from reef_core.wire import RELEASE_HEADER

router = APIRouter()
PARAMS = ("adapter", "release_id", "scenario")
_HOST = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,255}")


def _params(request: Request) -> dict[str, str]:
    query = request.query_params
    out = {}
    for key in query.keys():
        if key not in PARAMS:
            raise ValidationFailed(f"unknown query parameter {key!r}; allowed: {', '.join(PARAMS)}", param=key)
        values = query.getlist(key)
        if len(values) > 1:
            raise ValidationFailed(f"query parameter {key!r} is given more than once", param=key)
        if not values[0]:
            raise ValidationFailed(f"query parameter {key!r} is empty", param=key)
        out[key] = values[0]
    if "adapter" not in out:
        raise ValidationFailed("adapter is required: /reef/harness/install?adapter=<name>", param="adapter")
    return out


def _scenario(request: Request, params: dict[str, str]) -> str:
    header = single_header(request, SCENARIO_HEADER)
    from_header = header_text(header, SCENARIO_HEADER) if header is not None and header.strip() else None
    from_query = params.get("scenario")
    if from_header and from_query and from_header != from_query:
        raise ValidationFailed(f"{SCENARIO_HEADER} and ?scenario= name different scenarios", param="scenario")
    name = from_header or from_query
    if not name:
        raise ValidationFailed(f"missing or empty {SCENARIO_HEADER} (or ?scenario=)", param=SCENARIO_HEADER)
    return check_scenario_name(name, SCENARIO_HEADER if from_header else "scenario")


def _base_url(request: Request) -> str:
    """The address the client reached: forwarded headers first (a proxy in front), else the request's own."""
    proto = request.headers.get("x-forwarded-proto", "").split(",")[0].strip() or request.url.scheme
    host = request.headers.get("x-forwarded-host", "").split(",")[0].strip() or request.headers.get("host", "")
    if proto not in ("http", "https"):
        raise ValidationFailed("x-forwarded-proto must be http or https", param="x-forwarded-proto")
    if not _HOST.fullmatch(host or ""):
        raise ValidationFailed("the Host (or x-forwarded-host) header is not a host[:port]", param="host")
    return f"{proto}://{host}"


@router.get("/reef/harness/install")
async def install(request: Request):
    dep = request.app.state.reef
    params = _params(request)
    name = params["adapter"]
    try:
        # Only registered names: a ``module:Name`` path would import whatever a query names.
        adapter = dep.harness_adapter(name) if ":" not in name else None
    except UnknownComponent as exc:
        raise ValidationFailed(f"adapter: {exc.message}", param="adapter") from None
    if adapter is None:
        raise ValidationFailed("adapter must be a registered adapter name", param="adapter")
    url = _base_url(request)
    # The serving release of a scenario with no record yet is its seed: created here (an earlier release_id of it
    # cannot exist, so that request creates nothing).
    dep, scenario, surface = await harness_surface(request, _scenario(request, params),
                                                   create_seed="release_id" not in params)
    row, files = await asyncio.to_thread(read_release, dep, surface, scenario, params.get("release_id"))
    models = dep.model_ids() or ["reef"]
    rendered = adapter.render(dict(files), ModelBinding(url=url, scenario=scenario, model=models[0]))
    script = render_install_script(url=url, scenario=scenario, adapter_name=name, adapter=adapter,
                                   release_id=row.release_id, content_id=row.content_id, files=rendered)
    return Response(script, media_type="text/x-shellscript; charset=utf-8",
                    headers={"cache-control": "no-store", RELEASE_HEADER: row.release_id})
