"""Per-connection limits the HTTP parser does not enforce: header size and count, header and body read
timeouts, and a cap on open connections.

uvicorn's httptools protocol (the one uvicorn selects: httptools is a dependency) buffers an unterminated header
line without bound, never closes a connection that has not finished sending its headers, and only answers 503 past
``limit_concurrency`` once a request's headers are complete (so idle sockets still count against it).
:class:`LimitedHttpProtocol` adds those limits; every refusal is a complete response in the endpoint's error
dialect (the path is known once the request line is parsed) with ``connection: close``.

Closing a socket whose receive queue still holds the client's bytes makes the kernel send a reset, and a reset can
discard the answer before the client has read it (a client still sending a large body sees a broken pipe and no
answer). So a connection closed while its request is unread *lingers*: the answer and a FIN go out, what the client
still sends is read and dropped, and the socket closes when the client closes its end or after
:data:`LINGER_S`. This covers the refusals here and the application's own (a 413 with ``connection: close``, an
early answer to a request that asked to close).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from reef_core.errors import ConfigError
from reef_core.serve.errors import dialect_for_path, error_body

log = logging.getLogger("reef.serve")


@dataclass(frozen=True)
class ConnectionLimits:
    #: Request line plus all header lines, in bytes.
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 100
    #: Seconds from the connection's start (or a request's first byte) until its headers are complete.
    header_timeout_s: float = 10.0
    #: Seconds from a request's complete headers until its whole body has arrived.
    body_timeout_s: float = 60.0
    #: Open connections; one more is answered 503 and closed at once.
    max_connections: int = 1024

    @classmethod
    def from_config(cls, server) -> "ConnectionLimits":
        """The limits of the ``server`` config section; :class:`ConfigError` names a value that is not positive."""
        values = {}
        for name, kind in (("max_header_bytes", int), ("max_header_count", int), ("header_timeout_s", float),
                           ("body_timeout_s", float), ("max_connections", int)):
            value = kind(getattr(server, name))
            if not value > 0:
                raise ConfigError(f"server.{name} must be positive, got {value}")
            values[name] = value
        return cls(**values)


#: Longest a closing connection keeps reading (and dropping) the rest of an unread request.
LINGER_S = 5.0


class _Refused(Exception):
    """Raised inside a parser callback to abandon the request (the parser re-raises it from ``feed_data``)."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ConnectionLimits` (build it with :func:`protocol_class`)."""

    limits = ConnectionLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        #: Bytes received since the current request began, while its headers are incomplete.
        self._header_bytes = 0
        #: Header lines and their exact size in the current request (request target included).
        self._header_count = 0
        self._header_size = 0
        self._in_headers = False
        #: Between the parser's message-begin and message-complete (body bytes are not header bytes).
        self._message_open = False
        self._refusal: tuple[int, str, str] | None = None
        #: Closing after an answer while the request is unread (see the module's docstring).
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- connection --------------------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        over_cap = len(self.connections) >= self.limits.max_connections
        super().connection_made(_LingeringTransport(transport, self))
        if over_cap:
            self._refuse(503, "too many open connections; retry later", "overloaded")
            return
        self._await_headers()

    def connection_lost(self, exc) -> None:
        self._cancel_timers()
        self._cancel(self._linger_timer)
        self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        if not self._in_headers and not self._message_open:
            self._await_headers()  # the first bytes of the next request on a kept-alive connection
        if self._in_headers:
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # noqa: BLE001 - httptools wraps callback errors in HttpParserCallbackError
            if self._refusal is not None:
                self._refuse(*self._refusal)
            elif isinstance(exc, httptools.HttpParserUpgrade):
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            elif isinstance(exc, httptools.HttpParserError):
                self._refuse(400, "invalid HTTP request", "invalid_request")
            else:
                raise
            return
        if self._in_headers and self._header_bytes > self.limits.max_header_bytes:
            # Unterminated headers: refuse before the parser buffers any more of them.
            self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes", "headers_too_large")

    # -- parser callbacks --------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._message_open = True
        self._header_count = self._header_size = 0
        if not self._in_headers:
            self._await_headers()

    def on_url(self, url: bytes) -> None:
        self._header_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Exact accounting of complete headers (a chunk may hold headers and body, so bytes received are not).
        self._header_count += 1
        self._header_size += len(name) + len(value) + 4
        if self._header_count > self.limits.max_header_count:
            self._refusal = (431, f"more than {self.limits.max_header_count} request headers", "headers_too_large")
            raise _Refused()
        if self._header_size > self.limits.max_header_bytes:
            self._refusal = (431, f"request headers exceed {self.limits.max_header_bytes} bytes",
                             "headers_too_large")
            raise _Refused()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._cancel(self._header_timer)
        self._header_timer = None
        super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        self._message_open = False
        self._cancel(self._body_timer)
        self._body_timer = None
        super().on_message_complete()

    # -- timers and refusals -----------------------------------------------------------------------------------

    def _await_headers(self) -> None:
        self._in_headers = True
        self._header_bytes = 0
        self._cancel(self._header_timer)
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request started while the previous response is still being written: wait for it.
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)
            return
        if self._header_bytes == 0:
            self.transport.close()  # nothing was asked: nothing to answer
        else:
            self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s",
                         "request_timeout")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body:
            return
        if cycle.response_started:
            self.transport.close()  # the answer is already going out: only stop waiting for the body
        else:
            # The application, waiting for the body, sees a disconnect; its own answer goes nowhere.
            self._refuse(408, f"request body not received within {self.limits.body_timeout_s:g} s",
                         "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in the dialect of the request's path (when known) and close the connection."""
        self._cancel_timers()
        if self.transport.is_closing():
            return
        path = (self.url or b"").split(b"?", 1)[0].decode("latin-1") if getattr(self, "url", None) else ""
        body = json.dumps(error_body(dialect_for_path(path), status, message, code)).encode()
        head = [STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n", b"\r\n"]
        log.debug("refused a request from %s: %s", self.client, message)  # a flood must not flood the log
        self.transport.write(b"".join(head) + body)
        self.transport.close()  # lingers when the client may still be sending

    def _request_unread(self) -> bool:
        """Whether the client may still be sending the current request (headers or body)."""
        return self._message_open or (self._in_headers and self._header_bytes > 0)

    def _linger(self) -> None:
        """Close after what was written, reading and dropping what the client still sends (module docstring)."""
        transport = self.transport.raw
        if self._lingering or transport.is_closing():
            return
        self._lingering = True
        self._cancel_timers()
        self._unset_keepalive_if_required()
        self.pipeline.clear()  # requests sent after this one are not answered
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # an application still running writes nowhere and reads a disconnect
            cycle.message_event.set()
        try:
            transport.write_eof()  # FIN after the buffered answer; reading goes on
        except (NotImplementedError, RuntimeError, OSError):
            transport.close()
            return
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def _cancel_timers(self) -> None:
        self._cancel(self._header_timer)
        self._cancel(self._body_timer)
        self._header_timer = self._body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


class _LingeringTransport:
    """The connection's transport as its protocol and request cycles see it: ``close()`` lingers while the request
    is unread, writes after that are dropped, and it reads as closing from then on."""

    __slots__ = ("raw", "_protocol")

    def __init__(self, raw: asyncio.Transport, protocol: LimitedHttpProtocol):
        self.raw, self._protocol = raw, protocol

    def write(self, data) -> None:
        if not self._protocol._lingering:
            self.raw.write(data)

    def close(self) -> None:
        protocol = self._protocol
        if protocol._lingering:
            return  # the client's close or the linger timer ends it
        if self.raw.is_closing() or not protocol._request_unread():
            self.raw.close()
        else:
            protocol._linger()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self.raw.is_closing()

    def __getattr__(self, name):  # everything else is the socket transport's own
        return getattr(self.raw, name)


#: File descriptors kept free beside the connections: the record store, git, model files, logs.
_SPARE_FDS = 256


def reserve_descriptors(max_connections: int) -> None:
    """Raise the soft open-file limit so ``max_connections`` sockets fit beside the server's own files (the usual
    soft limit of 1024 would make ``accept`` fail first, with no answer at all); warn when the hard limit is lower."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < wanted:
            log.warning("server.max_connections=%d needs %d open files, but the hard limit is %d",
                        max_connections, wanted, hard)


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpProtocol]:
    """A :class:`LimitedHttpProtocol` subclass bound to ``limits`` (uvicorn instantiates the class itself)."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})
