"""The HTTP application: routes, authentication and one error table for every route."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from reef_core import __version__
from reef_core.errors import ReefError
from reef_core.serve.middleware.auth import ADMIN, EVAL, AuthMiddleware, OPEN_PATHS, TokenSet
from reef_core.serve.errors import dialect_for_path, error_body, new_error_id
from reef_core.serve.process.forward import ForwardToPrimary
from reef_core.serve.routes.inference import InferenceCall
from reef_core.serve.routes.names import scenario_header
from reef_core.serve.routes import canary
from reef_core.serve.schema import install_openapi
from reef_core.serve.middleware import metrics
from reef_core.serve.routes import (aliases, docs, evaluate, harness, imports, install, instructions, reads,
                                    releases, reports, scenario_routes, skills, ui)
from reef_core.serve.middleware.observe import ObserveMiddleware
from reef_core.serve.middleware.scenario_path import take_scenario_from_path
from reef_core.serve.middleware.usage import Usage
from reef_core.wire import INFERENCE_ROUTES

log = logging.getLogger("reef.serve")



def create_app(deployment, forward_to: str | None = None) -> FastAPI:
    """The app of ``reef serve``; ``forward_to`` (a worker process of ``server.workers``): the primary's Unix
    socket, where every request but inference for the scenarios this process serves is handed on."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await deployment.start()
        await app.state.reef_usage.start(deployment)
        try:
            yield
        finally:
            try:
                await app.state.reef_usage.stop(deployment)  # the last usage increments, before the store closes
            finally:
                try:
                    await deployment.stop()
                finally:
                    if app.reef_forward is not None:
                        await app.reef_forward.close()

    app = ReefApp(title="Reef", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    if forward_to is not None:
        app.reef_forward = ForwardToPrimary(forward_to)
    app.state.reef = deployment
    app.state.reef_metrics = metrics.ServeMetrics(deployment, deployment.server.metrics_max_scenarios)

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/v1/models")
    async def models(request: Request):
        ids = deployment.model_ids() or ["reef"]
        now = int(time.time())
        if request.headers.get("anthropic-version"):
            data = [{"id": m, "type": "model", "display_name": m, "created_at": "1970-01-01T00:00:00Z"} for m in ids]
            return {"data": data, "has_more": False, "first_id": ids[0], "last_id": ids[-1]}
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "reef"}
                                           for m in ids]}

    # Declared for routing, OpenAPI and HEAD/405 handling; POSTs to them take the fast path (ReefApp).
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await InferenceCall(deployment, request, *INFERENCE_ROUTES["/v1/chat/completions"]).run()

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await InferenceCall(deployment, request, *INFERENCE_ROUTES["/v1/messages"]).run()

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await InferenceCall(deployment, request, *INFERENCE_ROUTES["/v1/responses"]).run()

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await InferenceCall(deployment, request, *INFERENCE_ROUTES["/v1/messages/count_tokens"]).run()

    for router in (reads.router, reports.router, instructions.router, imports.router, releases.router, aliases.router,
                   evaluate.router, harness.router, install.router, skills.router, metrics.router, ui.router,
                   docs.router):
        app.include_router(router)
    app.include_router(canary.router)
    scenario_routes.mount(app, getattr(deployment, "pm", None))

    _install_error_handlers(app)
    install_openapi(app)  # request bodies and headers the routes read, in /openapi.json
    admin_routes, eval_routes = _marked_routes(app, ADMIN), _marked_routes(app, EVAL)
    tokens = app.state.reef_tokens = TokenSet.from_config(deployment.server)
    app.state.reef_usage = Usage(tokens)
    open_paths = OPEN_PATHS | ({"/metrics"} if deployment.server.metrics_public else set())
    inference_paths = frozenset(INFERENCE_ROUTES)
    app.add_middleware(AuthMiddleware, tokens=tokens, admin_routes=admin_routes, open_paths=open_paths,
                       inference_paths=inference_paths, eval_routes=eval_routes)
    # Outermost, so a request refused by the token check is counted and logged (and audited) too.
    app.add_middleware(ObserveMiddleware, metrics=app.state.reef_metrics, inference_routes=INFERENCE_ROUTES)
    app.reef_inference = ObserveMiddleware(
        AuthMiddleware(_inference_endpoint(app, deployment), tokens=tokens, admin_routes=admin_routes,
                       open_paths=open_paths, inference_paths=inference_paths, eval_routes=eval_routes),
        app.state.reef_metrics, INFERENCE_ROUTES)
    return app




def _marked_routes(app, extra: dict) -> list:
    """(path regex, methods) of the routes declaring ``openapi_extra=extra`` (the scope they need)."""
    return [(route.path_regex, frozenset(route.methods or ()))
            for route in iter_routes(app.routes) if getattr(route, "openapi_extra", None) == extra]


class ReefApp(FastAPI):
    """FastAPI, except that inference POSTs go straight from ASGI to :class:`InferenceCall`, behind the same
    :class:`AuthMiddleware` and with the same error bodies. Skipping FastAPI's middleware stack, router and
    endpoint wrapping saves CPU on every proxied request (measured in bench/README.md); every other route, and
    any other method on these paths, goes through FastAPI as before."""

    reef_inference = None  # set by create_app: the authenticated fast-path ASGI app
    #: In a worker process (``server.workers``): where every request but inference goes (the primary).
    reef_forward: ForwardToPrimary | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            take_scenario_from_path(scope)
        if (self.reef_inference is not None and scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in INFERENCE_ROUTES):
            scope["app"] = self
            return await self.reef_inference(scope, receive, send)
        if self.reef_forward is not None and scope["type"] in ("http", "websocket"):
            return await self.reef_forward(scope, receive, send)
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        answered = False

        async def tracked_send(message) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True

        try:
            await super().__call__(scope, receive, tracked_send)
        except Exception:
            # Starlette re-raises an unexpected error after its handler answered the 500 (already logged with
            # its id); raised further, the server would close the connection. Keep it open once answered.
            if not answered:
                raise


async def _served_here(deployment, request: Request) -> bool:
    """In a worker: whether this process answers the request (its scenario is stored and followed here). A new
    scenario's first requests, and any request whose scenario header is refused, go to the primary, which creates
    the scenario (and seeds its first release) or answers the refusal."""
    try:
        name = scenario_header(request)
        if not deployment.is_active(name):
            await deployment.resolve(name)
    except ReefError:
        return False
    return deployment.is_active(name)


def _inference_endpoint(app: FastAPI, deployment):
    async def endpoint(scope, receive, send) -> None:
        request = Request(scope, receive)
        if app.reef_forward is not None and not await _served_here(deployment, request):
            return await app.reef_forward(scope, receive, send)
        client_dialect, route = INFERENCE_ROUTES[scope["path"]]
        try:
            response = await InferenceCall(deployment, request, client_dialect, route).run()
        except ReefError as exc:
            response = _error_response(scope["path"], exc.status, exc.message, exc.code, exc.param,
                                       exc.details.get("retry_after"))
        except Exception:  # same answer as the app-wide handler of unexpected errors
            response = _internal_error(scope["method"], scope["path"])
        await response(scope, receive, send)

    return endpoint


def _error_response(path: str, status: int, message: str, code: str | None,
                    param: str | None = None, retry_after: int | None = None) -> JSONResponse:
    # A body refused as too large is left unread: close the connection rather than drain it.
    headers = {"connection": "close"} if status == 413 else {}
    if retry_after is not None:  # a rate limit says when to come back
        headers["retry-after"] = str(retry_after)
    return JSONResponse(error_body(dialect_for_path(path), status, message, code, param), status_code=status,
                        headers=headers)


def _internal_error(method: str, path: str) -> JSONResponse:
    """A 500 in the route's dialect for an unexpected exception (being handled), logged under an id the
    client also gets, so a report of the failure leads to its traceback."""
    error_id = new_error_id()
    log.exception("unhandled error %s on %s %s", error_id, method, path)
    return _error_response(path, 500, f"internal error (id {error_id})", "internal_error")


def iter_routes(routes):
    """Every endpoint route, descending into included routers (we mount them without prefixes)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from iter_routes(inner.routes)
        elif hasattr(route, "methods"):
            yield route


def _install_error_handlers(app: FastAPI) -> None:
    def respond(request: Request, status: int, message: str, code: str | None,
                param: str | None = None, retry_after: int | None = None) -> JSONResponse:
        return _error_response(request.url.path, status, message, code, param, retry_after)

    @app.exception_handler(ReefError)
    async def reef_error(request: Request, exc: ReefError):
        return respond(request, exc.status, exc.message, exc.code, exc.param, exc.details.get("retry_after"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        return respond(request, 400, f"{where}: {first.get('msg', 'invalid request')}".strip(": "), "invalid_request",
                       where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return respond(request, exc.status_code, str(exc.detail), None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        return _internal_error(request.method, request.url.path)
