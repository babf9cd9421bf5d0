"""A worker process hands the requests it does not answer itself to the primary (``server.workers``).

Only the primary runs the learners, keeps the commit log and answers reports, release operations, reads,
the dashboard and ``/metrics``; a worker answers inference for the scenarios it serves and passes everything
else, unchanged (method, path, query, headers, body), over the primary's private Unix socket, then streams the
primary's answer back as it comes. The primary authenticates the forwarded request as if it came directly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from reef_core.serve.errors import dialect_for_path, error_bytes

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger("reef.serve")

#: Hop-by-hop headers: they describe one connection, not the request, and are not passed on.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer",
                  b"upgrade"})
#: Any host: the Unix socket is the address; the request's own Host header is passed on.
_BASE = "http://reef-primary"


class ForwardToPrimary:
    """ASGI app that relays an HTTP request to the primary and its answer back (one pooled session)."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None
        # Set with the session: what a lost connection to the primary raises (aiohttp is not imported before).
        self._unreachable: type[BaseException] | tuple = ()

    def _client(self) -> aiohttp.ClientSession:
        # aiohttp is imported by a worker process only (~0.2 s of every primary's start-up otherwise, issue #41).
        import aiohttp

        if self._session is None or self._session.closed:
            self._unreachable = aiohttp.ClientConnectionError
            # No total timeout: a forwarded request may legitimately wait (a report that waits for its learner).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path, limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=10),
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # no websocket routes: refuse the upgrade as the primary would
            await send({"type": "websocket.close", "code": 1000})
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _HOP]
        target = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        url = _BASE + target.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")

        async def body():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return

        has_body = any(k == "content-length" and v != "0" for k, v in headers) or any(
            k == b"transfer-encoding" for k, _ in scope["headers"])
        started = False
        try:
            async with self._client().request(scope["method"], url, headers=headers,
                                              data=body() if has_body else None, allow_redirects=False,
                                              compress=None) as answer:
                await send({"type": "http.response.start", "status": answer.status,
                            "headers": [(k, v) for k, v in answer.raw_headers if k.lower() not in _HOP]})
                started = True
                async for chunk in answer.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except self._unreachable as exc:
            if started:  # cut mid-answer: the client's connection is closed the same way
                raise
            log.warning("could not reach the primary process for %s %s: %s", scope["method"], scope["path"], exc)
            body_bytes = error_bytes(dialect_for_path(scope["path"]), 503,
                                     "the primary process is not reachable; retry shortly", "unavailable")
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(body_bytes)).encode())]})
            await send({"type": "http.response.body", "body": body_bytes, "more_body": False})
