"""What the fake servers (``fake_upstream``, ``fake_sglang``, ``fake_vllm``) share of ASGI: the door of a request.

They are plain ASGI apps rather than FastAPI ones so that their timing and failures stay under the test's control.
"""

from __future__ import annotations


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
