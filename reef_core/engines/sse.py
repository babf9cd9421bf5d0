"""Server-sent events: an incremental decoder (bytes in, events out) and an encoder.

The decoder follows the WHATWG event-stream rules that matter for LLM providers: lines end with
``\\n``, ``\\r\\n`` or ``\\r`` (also when split across network chunks), ``data:`` lines of one event are
joined with ``\\n``, a single space after the colon is dropped, ``:`` lines are comments (keep-alives),
an event is dispatched on a blank line, and an event left incomplete at end of input is discarded.
"""

from __future__ import annotations

import json

from reef_core.engines.base import StreamEvent

_DONE = "[DONE]"


class SSEDecoder:
    """Feed raw bytes as they arrive; get back ``(event_name, data)`` pairs of complete events."""

    __slots__ = ("_buf", "_event", "_data", "_pending_cr")

    def __init__(self) -> None:
        self._buf = b""
        self._event: str | None = None
        self._data: list[str] = []
        self._pending_cr = False  # last chunk ended with \r: a leading \n of the next one is part of it

    def feed(self, chunk: bytes) -> list[tuple[str | None, str]]:
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._pending_cr = chunk.endswith(b"\r")
        buf = self._buf + chunk
        if b"\r" in buf:
            # Normalise line endings; a trailing \r is already a complete line end.
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        out: list[tuple[str | None, str]] = []
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line:
                if self._data:
                    out.append((self._event, "\n".join(self._data)))
                self._event, self._data = None, []
                continue
            self._line(line.decode("utf-8", errors="replace"))
        self._buf = buf[start:]
        return out

    def _line(self, line: str) -> None:
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value or None
        # "id" and "retry" carry nothing an LLM client needs.

    @property
    def buffered(self) -> int:
        """Bytes held for an event still being received (to bound a provider that never ends a line)."""
        return len(self._buf) + sum(len(d) for d in self._data)

    @property
    def has_partial(self) -> bool:
        """True when bytes of an unfinished event are buffered (a cut-off stream)."""
        return bool(self._buf.strip()) or bool(self._data)


def parse_data(event: str | None, data: str) -> StreamEvent:
    """Turn a decoded SSE pair into a :class:`StreamEvent` (JSON parsed, ``[DONE]`` kept as text).

    Raises ``ValueError`` on data that is neither JSON nor ``[DONE]``.
    """
    if data == _DONE:
        return StreamEvent(event, data)
    return StreamEvent(event, json.loads(data))


def encode_event(ev: StreamEvent) -> bytes:
    """Serialise one event in wire format (``event:`` line only when named)."""
    data = ev.data if isinstance(ev.data, str) else json.dumps(ev.data, separators=(",", ":"), ensure_ascii=False)
    lines = data.split("\n")
    head = f"event: {ev.event}\n" if ev.event else ""
    return (head + "".join(f"data: {line}\n" for line in lines) + "\n").encode("utf-8")
