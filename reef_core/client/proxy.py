"""The wrapper's local capture proxy: relays an agent's model calls to Reef, adding the scenario (and the token),
and spools each receipt it sees (header or in-band stream field) as the answer passes through.

Plain HTTP/1.0 on 127.0.0.1 with an OS-chosen port: every answer ends with the connection, so a stream is relayed
chunk by chunk without re-framing. Credentials the agent sends are replaced: only ``REEF_TOKEN`` reaches Reef.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from .capture import RECORD_ID_HEADER, RELEASE_HEADER, SCENARIO_HEADER, StreamScanner
from .spool import Spool

_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"})
_CREDENTIALS = frozenset({"authorization", "x-api-key"})


class CaptureProxy:
    """``with CaptureProxy(url, scenario, token, spool) as proxy:`` serves at ``proxy.url`` until the block ends."""

    def __init__(self, upstream: str, scenario: str, token: str | None, spool: Spool, timeout: float = 600.0):
        self.upstream = upstream.rstrip("/")
        self.scenario, self.token, self.spool = scenario, token, spool
        self.client = httpx.Client(timeout=timeout)
        self.captured: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:  # the agent's terminal is not ours to fill
                pass

            def _relay(self) -> None:
                proxy.relay(self)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="reef-capture-proxy", daemon=True)

    def __enter__(self) -> "CaptureProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def _capture(self, record_id: str, release_id: str | None) -> None:
        self.captured.append(record_id)
        self.spool.add(record_id, release_id)

    def relay(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("content-length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        if self.token:
            headers = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIALS}
            headers["authorization"] = f"Bearer {self.token}"
        headers[SCENARIO_HEADER] = self.scenario
        headers["accept-encoding"] = "identity"  # the scanner reads the bytes as they pass
        request = self.client.build_request(handler.command, self.upstream + handler.path, headers=headers,
                                            content=body)
        try:
            response = self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            handler.send_error(502, f"Reef unreachable: {exc}")
            return
        try:
            handler.send_response(response.status_code)
            for key, value in response.headers.multi_items():
                if key.lower() not in _HOP or key.lower() == "content-length":
                    handler.send_header(key, value)
            handler.end_headers()
            receipt = response.headers.get(RECORD_ID_HEADER)
            release = response.headers.get(RELEASE_HEADER)
            if receipt and response.status_code < 400:
                self._capture(receipt, release)
            # A cut stream's record never trains: nothing to report on.
            scanner = StreamScanner(lambda rid, complete: complete and self._capture(rid, release))
            scan = not receipt and response.headers.get("content-type", "").startswith("text/event-stream")
            for chunk in response.iter_raw():
                if scan:
                    scanner.feed(chunk)
                handler.wfile.write(chunk)
                handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent went away; Reef stores what it generated as incomplete
        finally:
            response.close()
