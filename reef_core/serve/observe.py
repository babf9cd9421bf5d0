"""One ASGI middleware that sees every request end: it feeds ``/metrics`` and writes the request log line.

It wraps both the FastAPI stack and the inference fast path (``ReefApp``). The inference call leaves what it
knows in the request state under ``reef_facts`` (scenario, receipt, upstream time, tokens); nothing is read
from bodies or headers, so no body, prompt or token can reach a log line.

The request line goes to the ``reef.access`` logger at INFO: with ``server.log_format=json`` it becomes one
JSON object (see :mod:`reef_core.serve.logs`); the plain-text default shows it only at ``log_level=debug``
because a line per proxied request costs more than the proxying itself.
"""

from __future__ import annotations

import logging
import time

from .metrics import ServeMetrics

access_log = logging.getLogger("reef.access")

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
        facts = (scope.get("state") or {}).get("reef_facts")
        self.metrics.observe(route, dialect, status, seconds, facts)
        if access_log.isEnabledFor(self.log_level):
            fields = {"method": scope["method"], "route": route, "status": status,
                      "total_ms": round(seconds * 1000, 3)}
            if facts:
                fields.update({k: v for k, v in facts.items() if k in _LOGGED_FACTS})
            access_log.log(self.log_level, "%s %s %s %.1fms", scope["method"], route, status, seconds * 1000,
                           extra={"reef": fields})


#: The request facts a log line may carry (an allow-list: a new fact is not logged by accident).
_LOGGED_FACTS = ("scenario", "receipt", "engine_ms", "tokens_in", "tokens_out", "stream")
