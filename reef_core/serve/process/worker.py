"""A worker process of ``server.workers`` (``python -m reef_core.serve.process.worker FD``; see :mod:`.workers`).

Started by the primary with one end of a socket pair as file descriptor ``FD``. The first line on it carries
the configuration (serving only), the port and the primary's Unix socket; later lines name scenarios whose head
moved or that were deleted. The worker sends back the scenarios it stored records for, coalesced over a few
milliseconds, and its metrics every second while they change. When the channel closes (the primary stopped or
died), the worker finishes its requests and exits.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import pickle
import socket
import sys
import threading
import time

from reef_core.serve.process.workers import send_line

log = logging.getLogger("reef.serve")

#: Records stored within this many seconds are reported to the primary in one line.
_COALESCE_S = 0.005
#: How often a worker sends its series to the primary (when they changed): a scrape is at most this stale.
_METRICS_S = 1.0


class _Channel:
    """The worker's end of its channel to the primary."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.lines = self.sock.makefile("rb")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def hello(self) -> dict:
        line = self.lines.readline()
        if not line:
            raise SystemExit(0)  # the primary is gone before we began
        return json.loads(line)

    def send(self, message: dict) -> None:
        send_line(self.sock, self._lock, message)  # the primary gone: the reader sees the channel close

    def stored(self, scenario: str) -> None:
        """Called on the event loop for each durable batch of records: tell the primary, a few at a time."""
        if not self._pending:
            self._loop = self._loop or asyncio.get_running_loop()
            self._loop.call_later(_COALESCE_S, self._flush)
        self._pending.add(scenario)

    def _flush(self) -> None:
        scenarios, self._pending = sorted(self._pending), set()
        if scenarios:
            self.send({"stored": scenarios})


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from reef_core.loop.assemble import build_deployment
    from reef_core.serve.app import create_app
    from reef_core.serve.middleware.connection import ConnectionLimits, protocol_class, reserve_descriptors
    from reef_core.serve.process.logs import configure as configure_logs
    from reef_core.serve.process.server import freeze_startup_objects
    from reef_core.serve.process.workers import listening_socket

    argv = list(sys.argv[1:] if argv is None else argv)
    channel = _Channel(int(argv[0]))
    hello = channel.hello()
    cfg = pickle.loads(base64.b64decode(hello["config"]))
    configure_logs(cfg.server)
    limits = ConnectionLimits.from_config(cfg.server)
    reserve_descriptors(limits.max_connections)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    deployment = build_deployment(cfg, role="serve", preload=True)
    deployment.on_records = channel.stored
    app = create_app(deployment, forward_to=hello["primary"])
    sock = listening_socket(cfg.server.host, cfg.server.port)
    config = uvicorn.Config(app, http=protocol_class(limits), ws="none", log_level=cfg.server.log_level,
                            access_log=False,
                            **({"log_config": None} if cfg.server.log_format == "json" else {}),
                            timeout_graceful_shutdown=30)
    class WorkerServer(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                freeze_startup_objects()

    server = WorkerServer(config)

    def listen() -> None:
        for line in channel.lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message.get("head"), str):
                deployment.follow_head(message["head"])
            if isinstance(message.get("archived"), str):
                deployment.forget_scenario(message["archived"])
        server.should_exit = True  # the primary is gone or stopping: finish what runs, then exit

    def report_metrics() -> None:
        from reef_core.serve.middleware.metrics import worker_report

        last = None
        while not server.should_exit:
            report = worker_report(app.state.reef_metrics.registry)
            if report != last:
                channel.send({"metrics": report})
                last = report
            time.sleep(_METRICS_S)

    threading.Thread(target=listen, name="reef-primary-channel", daemon=True).start()
    threading.Thread(target=report_metrics, name="reef-worker-metrics", daemon=True).start()
    log.info("worker %s serving port %d", hello.get("index"), cfg.server.port)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
