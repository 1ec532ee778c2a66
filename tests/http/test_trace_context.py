"""A harness's W3C trace context continues into the gateway's span: an agent call that carries `traceparent`
(and `tracestate`) gets a turn span in the harness's trace, child of the harness's span, and sampled as the
harness decided; a call without one, or with one that does not parse, starts a trace of its own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from gateway.access_log import CallContext

from support import TIMEOUT, until
from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
HARNESS_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{HARNESS_SPAN}-01"


@dataclass(frozen=True)
class Received:
    name: str
    trace_id: str
    parent_span_id: str
    """Empty for a trace's root span."""
    trace_state: str


class Collector:
    """An OTLP/HTTP trace receiver (protobuf POSTs to /v1/traces, answered 200) that keeps each span's
    place in its trace."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def received(self) -> list[Received]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = [
            Received(span.name, span.trace_id.hex(), span.parent_span_id.hex(), span.trace_state)
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with self._lock:
            self.spans.extend(spans)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                collector._take(self.rfile.read(int(self.headers["content-length"])))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def collector() -> Iterator[Collector]:
    found = Collector()
    yield found
    found.close()


@pytest.fixture
async def traced(start, collector, monkeypatch):
    """A gateway that sends its spans to `collector`, in batches a fifth of a second apart."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    gw = await start(otlp_endpoint=collector.url)
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))
    return gw


async def the_span(collector: Collector) -> Received:
    """The one span sent (spans leave in the order their turns ended: an earlier one would be here too)."""
    await until(collector.received, "the turn's span at the collector")
    (span,) = collector.received()
    return span


async def call(gw, headers: dict[str, str]) -> None:
    answer = await gw.client.post(
        "/rollouts/r1/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=headers,
    )
    assert answer.status_code == 200, answer.text


async def test_a_calls_traceparent_makes_the_turn_span_a_child_of_the_harness_span(traced, collector):
    await call(traced, {"traceparent": TRACEPARENT, "tracestate": "harness=run7,other=x"})

    assert await the_span(collector) == Received("chat tiny", TRACE_ID, HARNESS_SPAN, "harness=run7,other=x")


async def test_a_call_without_traceparent_starts_a_trace_of_its_own(traced, collector):
    await call(traced, {})

    span = await the_span(collector)
    assert (span.parent_span_id, span.trace_state) == ("", "")
    assert span.trace_id not in ("", TRACE_ID)


async def test_a_traceparent_that_does_not_parse_starts_a_trace_of_its_own(traced, collector):
    await call(traced, {"traceparent": f"00-{TRACE_ID}-not-a-span-01"})

    span = await the_span(collector)
    assert (span.parent_span_id, span.trace_state) == ("", "")
    assert span.trace_id != TRACE_ID


async def test_a_harness_that_did_not_sample_its_trace_gets_no_span(traced, collector):
    traced.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))
    await call(traced, {"traceparent": f"00-{'1' * 32}-{HARNESS_SPAN}-00"})
    await call(traced, {"traceparent": TRACEPARENT})

    assert await the_span(collector) == Received("chat tiny", TRACE_ID, HARNESS_SPAN, "")


async def test_without_the_access_log_the_call_context_middleware_carries_the_trace(
    start, collector, monkeypatch
):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    gw = await start(otlp_endpoint=collector.url, access_log=False)
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))
    transport = httpx.ASGITransport(app=CallContext(gw.app))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=TIMEOUT) as client:
        gw.client = client
        await call(gw, {"traceparent": TRACEPARENT})

    assert await the_span(collector) == Received("chat tiny", TRACE_ID, HARNESS_SPAN, "")
