"""Fuzz cases: one raw HTTP request each, and the JSON pieces they are made of.

A :class:`Case` keeps what the invariants need besides its bytes: the route it exercises (the
OpenAPI path template), the scenario names it carried (to tell which scenarios a refused request
could have created) and a short note of how it was mutated (to group failures by cause).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import quote


@dataclass(frozen=True)
class Raw:
    """JSON text spliced verbatim into a body (``10**400``, ``1e400``, deep nesting, ``NaN``)."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'…' if len(self.text) > 40 else ''} len={len(self.text)})"


def dump(value) -> str:
    """JSON text of ``value``; :class:`Raw` parts go in as they are."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k)) + ":" + dump(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def encode_header(value: str | bytes) -> bytes:
    """Header bytes: latin-1 when it fits (what a browser or curl sends), else UTF-8."""
    if isinstance(value, bytes):
        return value
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")


def path_segment(value: str | bytes, raw: bool = False) -> str:
    """A path segment: percent-encoded UTF-8, or (``raw``) the characters as they are."""
    if raw:
        return value if isinstance(value, str) else value.decode("latin-1")
    data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    return quote(data, safe="")


@dataclass
class Case:
    method: str
    route: str  # the OpenAPI path template, e.g. /reef/scenarios/{scenario}/records
    target: str  # what goes on the request line
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes | None = None
    #: scenario names the request carried (header or path), as the client sent them
    names: list[bytes] = field(default_factory=list)
    note: str = "valid"
    stream: bool = False

    @property
    def op(self) -> str:
        return f"{self.method} {self.route}"

    def to_bytes(self, host: str) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1".encode("utf-8", "surrogatepass"),
                 b"host: " + host.encode()]
        lines += [name + b": " + value for name, value in self.headers]
        if self.body is not None:
            lines.append(b"content-length: " + str(len(self.body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + (self.body or b"")

    def size(self) -> int:
        return len(self.target) + sum(len(n) + len(v) for n, v in self.headers) + len(self.body or b"")

    def describe(self, limit: int = 400) -> str:
        """The request, shortened for a report (long values cut, their length given)."""
        def cut(data: bytes) -> str:
            text = repr(data)[2:-1]
            return text if len(text) <= limit else f"{text[:limit]}… ({len(data)} bytes)"

        out = [f"{self.method} {cut(self.target.encode('utf-8', 'surrogatepass'))}"]
        out += [f"  {name.decode('latin-1')}: {cut(value)}" for name, value in self.headers
                if name.lower() not in (b"authorization", b"x-api-key")]
        if self.body is not None:
            out.append(f"  body: {cut(self.body)}")
        return "\n".join(out)
