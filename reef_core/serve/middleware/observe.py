"""One ASGI middleware that sees every request end: it feeds ``/metrics`` and writes the request log line.

It wraps both the FastAPI stack and the inference fast path (``ReefApp``). The inference call leaves what it
knows in the request state under ``reef_facts`` (scenario, receipt, upstream time, tokens); nothing is read
from bodies or headers, so no body, prompt or token can reach a log line.

The request line goes to the ``reef.access`` logger at INFO: with ``server.log_format=json`` it becomes one
JSON object (see :mod:`reef_core.serve.process.logs`); the plain-text default shows it only at ``log_level=debug``
because a line per proxied request costs more than the proxying itself.
"""

from __future__ import annotations

import logging
import time

from reef_core.serve.middleware.auth import PATH_SCENARIO
from reef_core.serve.middleware.metrics import ServeMetrics
from reef_core.wire import SCENARIO_HEADER

_SCENARIO_KEY = SCENARIO_HEADER.encode()

access_log = logging.getLogger("reef.access")
#: Admin actions and refused requests (401, 403, 429): token name (never the token), scenario, route, status.
audit_log = logging.getLogger("reef.audit")
AUDITED = frozenset({401, 403, 429})

#: The dialect label of a non-inference route under ``/v1`` (models, for instance); Reef's own routes: ``reef``.
_DIALECT_OF_PREFIX = (("/v1/messages", "anthropic"), ("/v1/", "openai"))


class ObserveMiddleware:
    """Pure ASGI: times the request, notes its status, then counts it and logs it."""

    def __init__(self, app, metrics: ServeMetrics, inference_routes: dict[str, tuple[str, str]],
                 log_requests_at: int = logging.INFO):
        self.app = app
        self.metrics = metrics
        self.inference_routes = inference_routes
        self.log_level = log_requests_at

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500  # an exception before any response start is answered 500 by the server

        async def noting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        finally:
            self._done(scope, status, time.perf_counter() - started)

    def _done(self, scope, status: int, seconds: float) -> None:
        path = scope["path"]
        known = self.inference_routes.get(path)
        if known is not None:
            dialect, route = known
        else:
            matched = scope.get("route")
            route = getattr(matched, "path", None) or "unmatched"  # a template: ids never become labels
            dialect = next((d for prefix, d in _DIALECT_OF_PREFIX if path.startswith(prefix)), "reef")
        state = scope.get("state") or {}
        facts = state.get("reef_facts")
        self.metrics.observe(route, dialect, status, seconds, facts)
        if status in AUDITED or state.get("reef_route_scope") == "admin":
            _audit(scope, state, facts, route, status)
        if access_log.isEnabledFor(self.log_level):
            fields = {"method": scope["method"], "route": route, "status": status,
                      "total_ms": round(seconds * 1000, 3)}
            if facts:
                fields.update({k: v for k, v in facts.items() if k in _LOGGED_FACTS})
            access_log.log(self.log_level, "%s %s %s %.1fms", scope["method"], route, status, seconds * 1000,
                           extra={"reef": fields})


def _audit(scope, state: dict, facts: dict | None, route: str, status: int) -> None:
    principal = state.get("reef_principal")
    fields = {"event": "refused" if status in AUDITED else "admin", "method": scope["method"], "route": route,
              "path": scope["path"][:512], "status": status, "token": principal.name if principal else None,
              "scenario": (facts or {}).get("scenario") or _scenario_of(scope)}
    audit_log.log(logging.WARNING if status in AUDITED else logging.INFO, "%s %s %s %s token=%s scenario=%s",
                  fields["event"], scope["method"], route, status, fields["token"], fields["scenario"],
                  extra={"reef": fields})


def _scenario_of(scope) -> str | None:
    """The scenario a request names: in its path, else in ``x-reef-scenario`` (as sent, cut to 255 bytes)."""
    found = PATH_SCENARIO.match(scope["path"])
    if found is not None:
        return found.group(1)
    for name, value in scope["headers"]:
        if name == _SCENARIO_KEY:
            return value[:255].decode("utf-8", "replace")
    return None


#: The request facts a log line may carry (an allow-list: a new fact is not logged by accident).
_LOGGED_FACTS = ("scenario", "receipt", "engine_ms", "tokens_in", "tokens_out", "stream")
