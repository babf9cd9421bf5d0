"""``GET /docs``: the OpenAPI document (``/openapi.json``) as one server-rendered HTML page.

FastAPI's own ``/docs`` loads Swagger UI from a CDN; a Reef machine may be offline, so this page is plain HTML
built from the same document: every route with its parameters, request body and responses. Documenting the
inference routes puts nothing on their fast path (they are answered before FastAPI's router, see ``ReefApp``).
"""

from __future__ import annotations

import json
from html import escape

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse

from reef_core.errors import ValidationFailed

from reef_core.serve.middleware.auth import SCOPE_EXTENSION

router = APIRouter()


def _schema(value) -> str:
    return f"<pre>{escape(json.dumps(value, indent=1, sort_keys=True)[:4000])}</pre>"


@router.get("/docs", response_class=HTMLResponse)
async def docs(request: Request):
    """Every route of this server, from its OpenAPI document."""
    if request.query_params:
        raise ValidationFailed("/docs takes no query parameters")
    spec = request.app.openapi()
    parts = [f"<p>{escape(spec['info']['title'])} {escape(spec['info']['version'])} · "
             '<a href="/openapi.json">openapi.json</a> (send the token as for every route)</p>']
    for path, item in sorted(spec.get("paths", {}).items()):
        for method, op in sorted(item.items()):
            scope = " (admin token)" if op.get(SCOPE_EXTENSION) == "admin" else ""
            params = "".join(f"<li><code>{escape(p['name'])}</code> in {escape(p['in'])}"
                             f"{' (required)' if p.get('required') else ''}</li>" for p in op.get("parameters", []))
            body = op.get("requestBody", {}).get("content", {})
            responses = ", ".join(escape(code) for code in sorted(op.get("responses", {})))
            parts.append(f'<section class="route"><h2><code>{method.upper()} {escape(path)}</code>{scope}</h2>'
                         f"<p>{escape(op.get('description') or op.get('summary') or '')}</p>"
                         + (f"<ul>{params}</ul>" if params else "")
                         + "".join(f"<p>Body ({escape(ct)}):</p>{_schema(c.get('schema', {}))}" for ct, c in body.items())
                         + f"<p>Responses: {responses}</p></section>")
    html = ('<!doctype html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
            "<title>Reef API</title><style>body{font:14px system-ui,sans-serif;max-width:1000px;margin:1.5em auto}"
            "pre{background:#f6f6f6;padding:6px;overflow:auto}</style></head><body><h1>Reef API</h1>"
            + "".join(parts) + "</body></html>")
    return HTMLResponse(html, headers={"cache-control": "no-store",
                                       "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                                                  "img-src data:"})
