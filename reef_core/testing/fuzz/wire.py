"""A socket-level HTTP/1.1 client for fuzzing: sends exactly the bytes it is given.

HTTP libraries refuse to send what a hostile client sends (control characters in header values,
non-ASCII request targets, invalid JSON with any content type), so the fuzzer writes the request
bytes itself and parses the answer here. A connection that ends before a complete response
(EOF, reset, a chunked body without its last chunk) is reported as :class:`Dropped`.
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass, field

MAX_HEAD = 256 * 1024
MAX_BODY = 64 * 1024 * 1024


class Dropped(Exception):
    """The server closed or reset the connection before a complete response."""


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    #: the server asked to close the connection (``connection: close``)
    closes: bool = False
    elapsed_s: float = 0.0

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)


@dataclass
class Wire:
    """One kept-alive connection to ``host:port``, reopened when the server has closed it."""

    host: str
    port: int
    timeout: float = 60.0
    sock: socket.socket | None = None
    _buffer: bytes = b""
    #: the previous response did not announce ``connection: close`` (a close before the next request is a drop)
    _expect_open: bool = field(default=False)
    _replied_at: float = 0.0

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self._buffer, self._expect_open = None, b"", False

    def closed_after_reply(self, idle_s: float = 1.0) -> bool:
        """True when the server closed the kept-alive connection after a response that did not announce it.

        A connection idle for more than ``idle_s`` is reopened without a verdict (servers close idle ones)."""
        if self.sock is None or not self._expect_open:
            return False
        if time.monotonic() - self._replied_at > idle_s:
            self.close()
            return False
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return False
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except OSError:
            data = b""
        if data:
            return False
        self.close()
        return True

    def request(self, raw: bytes) -> Reply:
        """Send ``raw`` (a whole request) and read one response; raises :class:`Dropped`."""
        if self.sock is None:
            self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._buffer = b""
        started = time.monotonic()
        try:
            self.sock.sendall(raw)
            reply = self._read_reply()
        except Dropped:
            self.close()
            raise
        except (OSError, socket.timeout) as exc:
            self.close()
            raise Dropped(f"{type(exc).__name__}: {exc}") from None
        self._replied_at = time.monotonic()
        reply.elapsed_s = self._replied_at - started
        if reply.closes:
            self.close()
        else:
            self._expect_open = True
        return reply

    # -- parsing ---------------------------------------------------------------------------------

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self._buffer += data
        return True

    def _read_until(self, marker: bytes, limit: int, what: str) -> bytes:
        while marker not in self._buffer:
            if len(self._buffer) > limit:
                raise Dropped(f"{what} longer than {limit} bytes")
            if not self._fill():
                raise Dropped(f"connection closed while reading the {what}" +
                              (f" (got {len(self._buffer)} bytes)" if self._buffer else " (no response)"))
        head, self._buffer = self._buffer.split(marker, 1)
        return head

    def _read_exact(self, n: int, what: str) -> bytes:
        while len(self._buffer) < n:
            if not self._fill():
                raise Dropped(f"connection closed in the {what} ({len(self._buffer)} of {n} bytes)")
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def _read_reply(self) -> Reply:
        head = self._read_until(b"\r\n\r\n", MAX_HEAD, "response head")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise Dropped(f"malformed status line {lines[0]!r}")
        status = int(parts[1])
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.append((name.strip().lower(), value.strip()))
        get = lambda n: next((v for k, v in headers if k == n), None)  # noqa: E731
        closes = (get("connection") or "").lower() == "close"
        if status in (204, 304) or 100 <= status < 200:
            body = b""
        elif (get("transfer-encoding") or "").lower() == "chunked":
            body = self._read_chunked()
        elif get("content-length") is not None:
            length = int(get("content-length"))
            if length > MAX_BODY:
                raise Dropped(f"content-length {length} over the client's limit")
            body = self._read_exact(length, "body")
        else:  # read to close
            while self._fill():
                if len(self._buffer) > MAX_BODY:
                    raise Dropped("body over the client's limit")
            body, self._buffer, closes = self._buffer, b"", True
        return Reply(status, headers, body, closes)

    def _read_chunked(self) -> bytes:
        chunks, total = [], 0
        while True:
            size_line = self._read_until(b"\r\n", 1024, "chunk size")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise Dropped(f"malformed chunk size {size_line[:40]!r}") from None
            if size == 0:
                self._read_until(b"\r\n", MAX_HEAD, "trailer")  # no trailers expected: the empty line
                return b"".join(chunks)
            total += size
            if total > MAX_BODY:
                raise Dropped("chunked body over the client's limit")
            chunks.append(self._read_exact(size, "chunk"))
            self._read_exact(2, "chunk end")
