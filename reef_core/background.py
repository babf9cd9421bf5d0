"""Serve an ASGI app (a stand-in model, a fake engine, a Reef app) on a loopback port from a daemon thread.

For examples, demos and tests that run Reef inside their own process; ``reef serve`` is the way to
run a server for real.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket (``port=0``: a free port), bound before the server starts so no port races."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def uvicorn_server(app, lifespan: str = "off"):
    import uvicorn

    config = uvicorn.Config(app, log_level="critical", access_log=False, lifespan=lifespan,
                            timeout_graceful_shutdown=1, timeout_keep_alive=30)
    return uvicorn.Server(config)


@contextlib.contextmanager
def serve_asgi(app, host: str = "127.0.0.1", port: int = 0, lifespan: str = "off") -> Iterator[str]:
    """Serve any ASGI app with uvicorn in a daemon thread on a free loopback port; yield its base URL.

    ``lifespan="on"`` sends the app ASGI lifespan startup/shutdown events (to open and close resources
    on the server's own event loop).
    """
    sock = bound_socket(host, port)
    server = uvicorn_server(app, lifespan)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="reef-asgi")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("ASGI server did not start")
        time.sleep(0.005)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
