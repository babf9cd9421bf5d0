"""Receipt capture at the HTTP layer, under any SDK: an httpx (or httpx-compatible) transport that adds Reef's
request headers and reads each response's receipt, from the ``x-reef-agent-record-id`` header of a plain answer
or from the in-band ``reef`` field of a stream (an extra OpenAI chunk before ``[DONE]``; Anthropic's
``message_stop``), as the stream is read.

The same :class:`StreamScanner` serves the wrapper's capture proxy, which sees raw bytes rather than httpx responses.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


from ..wire import RECORD_ID_HEADER, RELEASE_HEADER, SCENARIO_HEADER, TAG_PREFIX  # noqa: F401 - the client's names


@dataclass(frozen=True)
class Receipt:
    """One recorded exchange: ``record_id`` is what a report quotes; ``release_id`` the harness release that
    served it (harness scenarios only); ``streamed`` whether it came in-band; ``complete`` False for a cut stream."""

    record_id: str
    scenario: str
    release_id: str | None = None
    streamed: bool = False
    complete: bool = True
    at: float = field(default_factory=time.time)


class ReceiptLog:
    """The receipts a client captured, in arrival order (thread-safe: SDK calls may run on many threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: list[Receipt] = []
        self._session_start = 0

    def add(self, receipt: Receipt) -> None:
        with self._lock:
            self._all.append(receipt)

    def all(self) -> list[Receipt]:
        with self._lock:
            return list(self._all)

    def last(self) -> Receipt | None:
        with self._lock:
            return self._all[-1] if self._all else None

    def session(self) -> list[Receipt]:
        """Receipts since the last report that quoted the session (or since the start)."""
        with self._lock:
            return self._all[self._session_start:]

    def close_session(self, upto: int) -> None:
        with self._lock:
            self._session_start = max(self._session_start, upto)

    def __len__(self) -> int:
        with self._lock:
            return len(self._all)


def receipt_in_event(data: bytes) -> tuple[str, bool] | None:
    """``(record id, complete)`` from one SSE ``data:`` payload carrying Reef's in-band receipt, else None."""
    if b'"reef"' not in data:
        return None
    try:
        event = json.loads(data)
    except ValueError:
        return None
    reef = event.get("reef") if isinstance(event, dict) else None
    if isinstance(reef, dict) and isinstance(reef.get("agent_record_id"), str):
        return reef["agent_record_id"], reef.get("complete", True) is not False
    return None


class StreamScanner:
    """Feed it a byte stream chunk by chunk; it finds the receipt in the SSE ``data:`` lines (lines may split
    across chunks) and calls ``found(record_id, complete)`` once."""

    def __init__(self, found: Callable[[str, bool], None]):
        self._found = found
        self._partial = b""
        self.seen = False

    def feed(self, chunk: bytes) -> None:
        if self.seen:
            return
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                hit = receipt_in_event(line[5:].strip())
                if hit is not None:
                    self.seen = True
                    self._found(*hit)
                    return



def _is_stream(response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


class _Capture:
    """What both transports share: headers added to each request, receipts read from each response."""

    def __init__(self, scenario: str, headers: dict[str, str], log: ReceiptLog):
        self.scenario, self.headers, self.log = scenario, headers, log

    def prepare(self, request) -> None:
        for name, value in self.headers.items():
            if name not in request.headers:
                request.headers[name] = value
        # Compressed bytes would hide the in-band receipt from the scanner.
        request.headers["accept-encoding"] = "identity"

    def scanner_for(self, response) -> StreamScanner | None:
        release = response.headers.get(RELEASE_HEADER)
        receipt = response.headers.get(RECORD_ID_HEADER)
        if receipt:
            self.log.add(Receipt(receipt, self.scenario, release, streamed=False))
            return None
        if not _is_stream(response) or response.status_code >= 400:
            return None
        return StreamScanner(lambda rid, complete: self.log.add(
            Receipt(rid, self.scenario, release, streamed=True, complete=complete)))



@functools.lru_cache(maxsize=None)
def _transport_classes(module):
    """The capture transports built on ``module``: ``httpx``, or a fork with its API (the Anthropic SDK ships on
    ``httpx2`` and refuses plain ``httpx`` objects)."""

    class ScannedStream(module.SyncByteStream):
        def __init__(self, inner, scanner: StreamScanner):
            self._inner, self._scanner = inner, scanner

        def __iter__(self):
            for chunk in self._inner:
                self._scanner.feed(chunk)
                yield chunk

        def close(self) -> None:
            self._inner.close()

    class AsyncScannedStream(module.AsyncByteStream):
        def __init__(self, inner, scanner: StreamScanner):
            self._inner, self._scanner = inner, scanner

        async def __aiter__(self):
            async for chunk in self._inner:
                self._scanner.feed(chunk)
                yield chunk

        async def aclose(self) -> None:
            await self._inner.aclose()

    class CaptureTransport(module.BaseTransport):
        """Adds Reef's headers to each request and logs each response's receipt."""

        def __init__(self, capture: _Capture, inner=None):
            self._capture = capture
            self._inner = inner or module.HTTPTransport()

        def handle_request(self, request):
            self._capture.prepare(request)
            response = self._inner.handle_request(request)
            scanner = self._capture.scanner_for(response)
            if scanner is not None:
                response.stream = ScannedStream(response.stream, scanner)
            return response

        def close(self) -> None:
            self._inner.close()

    class AsyncCaptureTransport(module.AsyncBaseTransport):
        """The asynchronous twin of ``CaptureTransport``."""

        def __init__(self, capture: _Capture, inner=None):
            self._capture = capture
            self._inner = inner or module.AsyncHTTPTransport()

        async def handle_async_request(self, request):
            self._capture.prepare(request)
            response = await self._inner.handle_async_request(request)
            scanner = self._capture.scanner_for(response)
            if scanner is not None:
                response.stream = AsyncScannedStream(response.stream, scanner)
            return response

        async def aclose(self) -> None:
            await self._inner.aclose()

    return CaptureTransport, AsyncCaptureTransport


def capture_client(module, scenario: str, headers: dict[str, str], log: ReceiptLog, *, asynchronous: bool = False,
                   timeout: float = 60.0):
    """A ``module.Client`` (or ``AsyncClient``) adding ``headers`` to each request and logging receipts in ``log``;
    ``module`` is ``httpx`` or the fork an SDK is built on."""
    sync_cls, async_cls = _transport_classes(module)
    capture = _Capture(scenario, headers, log)
    if asynchronous:
        return module.AsyncClient(transport=async_cls(capture), timeout=timeout)
    return module.Client(transport=sync_cls(capture), timeout=timeout)
