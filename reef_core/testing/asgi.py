"""What the fake servers (``fake_upstream``, ``fake_sglang``, ``fake_vllm``) share: the ASGI door of a request and
the subprocess that runs one with ``mode="process"``.

They are plain ASGI apps rather than FastAPI ones so that their timing and failures stay under the test's control.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator


async def read_request(scope, receive, send) -> bytes | None:
    """The whole body of an HTTP request; None for anything else (a lifespan is answered here until shutdown)."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return None
    if scope["type"] != "http":
        return None
    raw = bytearray()
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            return bytes(raw)


@contextlib.contextmanager
def fake_in_process(cmd: list[str], banner: str, what: str) -> Iterator[str]:
    """Run a fake server's ``python -m`` command and yield the URL it prints as ``<banner> <url>`` once listening;
    it is terminated (then killed) on exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith(f"{banner} "):
            raise RuntimeError(f"{what} failed to start: {line!r}")
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
