"""``reef serve``: build the deployment from the composed config and run uvicorn."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

from reef_core.config.schema import ReefConfig
from reef_core.errors import ConfigError, ReefError
from reef_core.serve.middleware.auth import TokenSet, is_loopback
from reef_core.serve.process.logs import configure as configure_logs
from reef_core.background import serve_asgi
from reef_core.serve.process.workers import WorkerPool, check_workers

log = logging.getLogger("reef.serve")


def check_bind(cfg: ReefConfig) -> None:
    if not is_loopback(cfg.server.host) and not TokenSet.from_config(cfg.server).enabled:
        raise ConfigError(
            f"refusing to bind {cfg.server.host}: no token is configured, so anyone on the network could use "
            "this server; set server.tokens (or REEF_TOKEN), or bind 127.0.0.1"
        )


def check_port_free(cfg: ReefConfig) -> None:
    """A port another process listens on: one ``reef: error:`` line (exit 1) before the model loads, not uvicorn's
    bind error (exit 3) after it (issue #37). Asked the way uvicorn binds (``SO_REUSEADDR``: a port left in
    TIME_WAIT by a server that just stopped is free); two servers started at the same instant may still meet at
    uvicorn's bind."""
    import errno
    import socket

    host, port = cfg.server.host.strip("[]"), cfg.server.port
    if not port:
        return  # port 0: the OS picks a free one
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ReefError(f"port {port} is already in use on {cfg.server.host} (another process listens there); "
                            f"stop it, or choose another port with server.port=N") from None
        if exc.errno == errno.EACCES:
            raise ReefError(f"port {port} on {cfg.server.host} needs privileges this user lacks; "
                            f"choose a port above 1023 with server.port=N") from None
        raise ReefError(f"cannot listen on {cfg.server.host}:{port}: {exc.strerror or exc}") from None
    finally:
        sock.close()


def serve(cfg: ReefConfig) -> int:
    from reef_core.loop.assemble import build_deployment

    from reef_core.serve.middleware.connection import ConnectionLimits, protocol_class, reserve_descriptors

    check_bind(cfg)
    workers = check_workers(cfg.server)
    configure_logs(cfg.server)
    limits = ConnectionLimits.from_config(cfg.server)
    reserve_descriptors(limits.max_connections)
    # One log line per proxied request would cost more than the proxying itself.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # The engine loads its model from here on, on a thread of its own: the app's modules are imported and the app
    # built meanwhile (start-up, issue #23).
    # A busy port is refused once the config has passed its checks (a bad config is exit 2 whatever the port),
    # before the model loads.
    deployment = build_deployment(cfg, preload=True, before_build=lambda: check_port_free(cfg))
    import uvicorn

    from reef_core.serve.app import create_app

    deployment.announce_startup()
    app = create_app(deployment)
    # The httptools protocol with Reef's connection limits (header size and count, read timeouts, connection cap).
    # No websocket protocol: Reef has no websocket route, and uvicorn would otherwise load a websocket library
    # into the process when one is installed; an upgrade request is answered as plain HTTP.
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, http=protocol_class(limits), ws="none",
                            log_level=cfg.server.log_level, access_log=False,
                            # JSON: uvicorn's own lines go through the root handler too, one object a line.
                            **({"log_config": None} if cfg.server.log_format == "json" else {}),
                            timeout_graceful_shutdown=30)
    # Most of start-up's objects exist now: frozen while the engine may still be loading, so that the collection
    # once uvicorn listens (what its start-up and the lifespan built) walks little.
    freeze_startup_objects(collect=False)
    if workers == 1:
        server = _announcing_server(config, ready_banner(cfg))
        server.run()
        return 0 if server.started else 1
    pool = WorkerPool(cfg, deployment, app.state.reef_metrics)
    try:
        sockets = pool.bind()
    except OSError as exc:
        raise ConfigError(f"cannot listen on {cfg.server.host}:{cfg.server.port}: {exc.strerror or exc}") from None
    server = _announcing_server(config, ready_banner(cfg, pool.port) + f"\n  workers          {workers} processes",
                                pool)
    server.run(sockets=sockets)
    return 0 if server.started else 1


def ready_banner(cfg: ReefConfig, port: int | None = None) -> str:
    """What ``reef serve`` prints once it accepts requests: where to send them, where to look, what serves."""
    host = cfg.server.host
    shown = f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)
    url = f"http://{shown}:{port or cfg.server.port}"
    if cfg.engine.kind == "local":
        model = f"{cfg.engine.model} (embedded)"
    else:
        model = f"{cfg.engine.upstream_model or 'as requested'} via {cfg.engine.kind} {cfg.engine.upstream_url or ''}"
    return "\n".join([f"Reef is ready at {url}",
                      f"  dashboard        {url}/ui",
                      f"  OpenAI base URL  {url}/v1",
                      f"  metrics          {url}/metrics",
                      f"  recipe           {cfg.recipe.name}",
                      f"  model            {model.strip()}"])


def freeze_startup_objects(collect: bool = True) -> None:
    """What start-up built (modules, config, the engine, plugins) lives as long as the server process: moved out of
    the cyclic collector's sight, a full collection walks only what requests leave behind, so it no longer adds
    milliseconds to the request it lands on (the latency tail). Only for a server process: objects frozen here are
    never collected as cycles. The collector runs from here on (``reef serve`` keeps it off during start-up); called
    again, it collects and freezes only what was built since.

    ``collect=False`` freezes without collecting first: with the model loaded the pass walked ~400k objects in 0.2 s
    of the main thread before the server could listen, to free ~7,000 objects (0.7 MB: closures, type aliases of
    imports); ``reef serve`` collects the composition's cycles earlier, and keeps the rest."""
    import gc

    if collect:
        gc.collect()
    gc.freeze()
    gc.enable()


def _announcing_server(config, banner: str, pool: WorkerPool | None = None):
    """uvicorn's server, printing :func:`ready_banner` once it listens (on stdout: it is not a log line); with
    ``server.workers``, it starts the workers once it listens and stops them with itself."""
    import asyncio

    import uvicorn

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                freeze_startup_objects()
                if pool is not None:
                    await asyncio.to_thread(pool.start)
                print(banner, flush=True)

        async def shutdown(self, sockets=None):
            if pool is not None:
                pool.signal_stop()  # the workers drain their requests while this process drains its own
            try:
                await super().shutdown(sockets=sockets)
            finally:
                if pool is not None:
                    await asyncio.to_thread(pool.wait, config.timeout_graceful_shutdown or 30)

    return AnnouncingServer(config)


@contextlib.contextmanager
def serve_reef(overrides: Sequence[str] = ()) -> Iterator[str]:
    """A whole Reef server (config ``overrides`` as on the ``reef serve`` command line) in this process;
    yield its base URL. The deployment is assembled and closed exactly as ``reef serve`` does it."""
    from reef_core.config import compose_config
    from reef_core.loop.assemble import build_deployment
    from reef_core.plugins import get_plugin_manager
    from reef_core.serve.app import create_app

    pm = get_plugin_manager()
    deployment = build_deployment(compose_config(list(overrides), pm), pm)
    with serve_asgi(create_app(deployment), lifespan="on") as url:
        yield url
