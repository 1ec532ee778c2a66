"""A real OTLP/HTTP trace receiver for the tests of the gateway's spans (tests/engine/test_telemetry.py, the
trace context's tests in tests/http/)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

ARRIVAL_TIMEOUT = 60.0
"""Seconds for an exported span to reach the receiver (the SDK sends a batch every few seconds at most)."""


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status: int
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    trace_id: str
    parent_span_id: str
    """Empty for a trace's root span."""
    trace_state: str


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as Python's."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain(item) for item in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


def as_dict(pairs: Any) -> dict[str, Any]:
    return {pair.key: plain(pair.value) for pair in pairs}


class OtlpReceiver:
    """An OTLP/HTTP trace receiver, as a collector serves one: protobuf `ExportTraceServiceRequest`s POSTed to
    /v1/traces, each answered 200 with an empty `ExportTraceServiceResponse`; it keeps the spans."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.arrived = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def wait_for(self, count: int) -> list[ReceivedSpan]:
        """The spans once `count` have arrived (more are a failure)."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.spans) >= count, ARRIVAL_TIMEOUT), (
                f"{len(self.spans)} of {count} spans arrived in {ARRIVAL_TIMEOUT:.0f} s"
            )
            assert len(self.spans) == count, self.spans
            return list(self.spans)

    def take(self, request: ExportTraceServiceRequest) -> None:
        received = [
            received_span(span, as_dict(resource_spans.resource.attributes))
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        with self.arrived:
            self.spans.extend(received)
            self.arrived.notify_all()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.path != "/v1/traces":
                    self.send_error(404)
                elif self.headers["content-type"] != "application/x-protobuf":
                    self.send_error(415)
                else:
                    receiver.take(ExportTraceServiceRequest.FromString(body))
                    reply = ExportTraceServiceResponse().SerializeToString()
                    self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                    self.send_header("content-length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def received_span(span: Span, resource: dict[str, Any]) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        kind=span.kind,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        status=span.status.code,
        status_message=span.status.message,
        attributes=as_dict(span.attributes),
        resource=resource,
        trace_id=span.trace_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        trace_state=span.trace_state,
    )
