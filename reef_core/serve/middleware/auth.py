"""Bearer-token authentication: which principal a token is, and whether it may call this route.

* ``GET /healthz`` and the dashboard's login page are open without a token (and ``GET /metrics`` with
  ``server.metrics_public=true``).
* Dashboard pages (``/ui...``) also take the token from the ``reef_ui_token`` cookie its login form sets; a
  browser without a valid one is sent to ``/ui/login``.
* ``Authorization: Bearer <token>`` (scheme case-insensitive); when absent, ``x-api-key``
  (what Anthropic SDKs send) is accepted.
* A token is looked up by its SHA-256 digest (:mod:`reef_core.serve.middleware.tenancy`) and never logged; its principal
  (name, scopes, scenario patterns) goes into the request state as ``reef_principal``.
* Each route needs a scope: ``infer`` (inference POSTs), ``report`` (``POST /reef/report``, record imports,
  ``POST /reef/train``), ``admin`` (routes marked admin: rollback, promote, delete, close-day), ``eval`` (routes
  marked eval: evaluate; admin passes too) or ``read`` (everything else); a token without it gets 403. A scenario named in the path (``/reef/scenarios/{s}/...``, ``/ui/scenarios/{s}/...``) or
  in ``x-reef-scenario`` outside the token's patterns is a 403 naming it, here, before any body is read (and again
  where a route reads the header: :func:`reef_core.serve.routes.names.scenario_header`). ``GET /metrics`` labels every
  scenario, so it needs an all-scenario token.
* With no token configured at all, authentication is off; ``reef serve`` refuses to bind a
  non-loopback address in that state.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import unquote

from reef_core.serve.errors import dialect_for_path, error_bytes
from reef_core.serve.middleware.tenancy import OPEN, Principal, Tenancy
from reef_core.wire import SCENARIO_HEADER

_SCENARIO_KEY = SCENARIO_HEADER.encode()

#: The OpenAPI extension that marks a route as needing the admin scope (rollback, promote, delete...), as routes
#: declare it: ``@router.post(..., openapi_extra=ADMIN)``.
SCOPE_EXTENSION = "x-reef-scope"
ADMIN = {SCOPE_EXTENSION: "admin"}
#: Routes an ``eval`` (or an admin) token may call: ``POST /reef/scenarios/{s}/evaluate``.
EVAL = {SCOPE_EXTENSION: "eval"}
#: A scope a route needs -> scopes that pass it too.
IMPLIED_BY = {"eval": frozenset({"admin"})}

OPEN_PATHS = frozenset({"/healthz", "/ui/login"})
#: The dashboard's cookie: the token its login form stored, read for ``/ui`` paths only.
UI_COOKIE = "reef_ui_token"


class TokenSet(Tenancy):
    """The configured tokens (see :class:`~reef_core.serve.middleware.tenancy.Tenancy`) under their older name."""

    def scope_of(self, token: str) -> str | None:
        """``admin``, ``inference`` or ``None`` (unknown token): the two-level view older callers use."""
        principal = self.principal(token) if token else None
        return principal.legacy_scope if principal is not None else None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _presented_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    authorization = api_key = None
    for name, value in headers:
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"x-api-key":
            api_key = value.decode("latin-1")
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return api_key


#: Routes needing the ``report`` scope (they store records without inference: reports, imports, instructions);
#: inference paths need ``infer``.
REPORT_PATHS = frozenset({"/reef/report", "/reef/records", "/reef/records/batch", "/reef/train"})
#: The scenario a path names, for every route under a scenario.
PATH_SCENARIO = re.compile(r"^/(?:reef|ui)/scenarios/([^/]+)")


class AuthMiddleware:
    """Pure ASGI middleware: checks the token, its scope and a path's scenario before any routing or body parsing."""

    def __init__(self, app, tokens: Tenancy, admin_routes: list[tuple[re.Pattern, frozenset[str]]],
                 open_paths: frozenset[str] = OPEN_PATHS, inference_paths: frozenset[str] = frozenset(),
                 eval_routes: list[tuple[re.Pattern, frozenset[str]]] = ()):
        self.app = app
        self.open_paths = open_paths
        self.tokens = tokens
        self.admin_routes = admin_routes
        self.inference_paths = inference_paths
        self.eval_routes = list(eval_routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or not self.tokens.enabled:
            if scope["type"] == "http":
                state = scope.setdefault("state", {})
                state["reef_scope"] = "admin"
                state["reef_principal"] = OPEN
            return await self.app(scope, receive, send)
        path = scope["path"]
        dashboard = path == "/ui" or path.startswith("/ui/")
        token = _presented_token(scope["headers"])
        if token is None and dashboard:
            token = _cookie_token(scope["headers"])
        principal = self.tokens.principal(token) if token else None
        state = scope.setdefault("state", {})
        needed = self.needed_scope(scope["method"], path)
        state["reef_route_scope"] = needed
        if principal is None:
            if dashboard and scope["method"] in ("GET", "HEAD"):
                return await _redirect(send, "/ui/login")
            return await _deny(send, path, 401, "invalid service token")
        state["reef_principal"] = principal
        state["reef_scope"] = principal.legacy_scope
        if not principal.all_scenarios:
            refused = _outside_scope(principal, path, scope["headers"])
            if refused is not None:
                return await _deny(send, path, 403, refused)
        if needed is not None and not ({needed} | IMPLIED_BY.get(needed, set())) & principal.scopes:
            message = ("this route needs an admin token" if needed == "admin"
                       else f"token {principal.name!r} lacks the {needed!r} scope this route needs")
            return await _deny(send, path, 403, message)
        return await self.app(scope, receive, send)

    def needed_scope(self, method: str, path: str) -> str | None:
        if method == "POST" and path in self.inference_paths:
            return "infer"
        if method == "POST" and path in REPORT_PATHS:
            return "report"
        if self._is_admin_route(method, path):
            return "admin"
        if any(method in methods and regex.match(path) for regex, methods in self.eval_routes):
            return "eval"
        if path in ("/ui/logout", "/v1/models"):  # an inference-only token's SDK lists models too
            return None
        return "read"

    def _is_admin_route(self, method: str, path: str) -> bool:
        return any(methods and method in methods and regex.match(path) for regex, methods in self.admin_routes)


def _outside_scope(principal: Principal, path: str, headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a scenario-confined token may not call ``path``, or None. Checked before any body is read, so a request
    naming another scenario learns nothing else (not even whether its body would pass)."""
    if path == "/metrics":
        return f"/metrics covers every scenario; token {principal.name!r} is confined to some"
    named = []
    found = PATH_SCENARIO.match(path)
    if found is not None:
        named.append(found.group(1))
    for key, value in headers:
        if key == _SCENARIO_KEY:
            try:  # an undecodable or invalid name is the route's 400 to give
                named.append(value.decode("utf-8").strip())
            except UnicodeDecodeError:
                pass
    for scenario in named:
        if scenario and not principal.allows(scenario):
            return f"token {principal.name!r} is not scoped to scenario {scenario!r}"
    return None


async def _deny(send, path: str, status: int, message: str) -> None:
    body = error_bytes(dialect_for_path(path), status, message, "unauthorized" if status == 401 else "forbidden")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _cookie_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, found = part.strip().partition("=")
                if key == UI_COOKIE and found:
                    return unquote(found)  # the login form stores it percent-encoded
    return None


async def _redirect(send, location: str) -> None:
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location.encode()), (b"content-length", b"0"),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": b""})
