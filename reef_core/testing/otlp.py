"""A real OTLP trace receiver on loopback for tests: ``POST /v1/traces`` (http/protobuf) or the gRPC TraceService,
each request decoded with the OpenTelemetry protobuf (``ExportTraceServiceRequest``) into plain :class:`Span` values.

``receiver.fail = True`` answers every export with 503 (gRPC: UNAVAILABLE); ``receiver.delay_s`` holds each answer
that long (a slow collector). Needs the ``otel`` extra (``opentelemetry-proto``; grpcio for gRPC).
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


@dataclass
class Span:
    trace_id: str
    span_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    #: ``(trace id, span id, attributes)`` of each link, ids in hex.
    links: list[tuple[str, str, dict]]
    resource: dict[str, Any]
    status_code: int
    start_ns: int
    end_ns: int
    parent_span_id: str = ""
    scope: str = ""
    events: list = field(default_factory=list)


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    return getattr(any_value, kind) if kind else None


def _attributes(pairs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(request: ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(Span(trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), name=s.name, kind=s.kind,
                                  attributes=_attributes(s.attributes),
                                  links=[(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                                         for link in s.links],
                                  resource=resource, status_code=s.status.code, start_ns=s.start_time_unix_nano,
                                  end_ns=s.end_time_unix_nano, parent_span_id=s.parent_span_id.hex(),
                                  scope=scope_spans.scope.name))
    return spans


class _Receiver:
    def __init__(self):
        self.fail = False
        self.delay_s = 0.0
        self.requests = 0
        self._spans: list[Span] = []
        self._headers: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def _take(self, payload: bytes, headers: dict[str, str]) -> bool:
        """Decode one export; False when the receiver is told to fail it."""
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self.requests += 1
            if self.fail:
                return False
            request = ExportTraceServiceRequest()
            request.ParseFromString(payload)
            self._spans.extend(decode(request))
            self._headers.append(headers)
            return True

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    @property
    def headers(self) -> list[dict[str, str]]:
        with self._lock:
            return list(self._headers)

    def traces(self) -> dict[str, list[Span]]:
        out: dict[str, list[Span]] = {}
        for span in self.spans:
            out.setdefault(span.trace_id, []).append(span)
        return out


class HttpReceiver(_Receiver):
    """``POST /v1/traces`` on a free loopback port; ``url`` is the endpoint to configure."""

    def __init__(self):
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                ok = receiver._take(body, {k.lower(): v for k, v in self.headers.items()})
                payload = ExportTraceServiceResponse().SerializeToString() if ok else b""
                self.send_response(200 if ok else 503)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the exporter gave up waiting (a slow receiver)
                    pass

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "HttpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver(_Receiver):
    """The gRPC ``TraceService`` on a free loopback port; ``url`` is the endpoint to configure."""

    def __init__(self):
        super().__init__()
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's name
                headers = {k: v for k, v in context.invocation_metadata()}
                if not receiver._take(request.SerializeToString(), headers):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "told to fail")
                return ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "GrpcReceiver":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)
