"""Each ended turn as an OpenTelemetry span (the GenAI semantic conventions' inference span), sent over
OTLP/HTTP, so that the model calls of a run show in the tracing backend a team already uses, next to its other
services. Off unless `--otlp-endpoint` is given; the packages come with the `otel` extra, imported only
then, so a gateway without them runs as before."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gateway import __version__
from gateway.store.records import TurnRecord
from rollout_store.status import TurnStatus

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

SERVICE = "rl-gateway"
PROVIDER = "vllm"
"""`gen_ai.provider.name`: the conventions list no value for vLLM, which serves every turn."""
PREFIX = "rl_gateway."
"""The gateway's own attributes, apart from the conventions' names."""
REQUIRED = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")

_SAMPLING: tuple[tuple[str, tuple[str, ...], type], ...] = (
    ("gen_ai.request.max_tokens", ("max_tokens", "max_completion_tokens"), int),
    ("gen_ai.request.temperature", ("temperature",), float),
    ("gen_ai.request.top_p", ("top_p",), float),
    ("gen_ai.request.top_k", ("top_k",), int),
    ("gen_ai.request.seed", ("seed",), int),
    ("gen_ai.request.frequency_penalty", ("frequency_penalty",), float),
    ("gen_ai.request.presence_penalty", ("presence_penalty",), float),
)
"""The conventions' request attributes, each with the engine's fields that give it (first present wins)."""

incoming: ContextVar[dict[str, str] | None] = ContextVar("incoming", default=None)
"""The W3C trace context a harness sent with the call this task serves (`traceparent`, `tracestate`), set by
the access log's middleware: the turn's span continues the harness's trace. Kept as the headers, parsed only
when a span is made."""
TRACE_HEADERS = (b"traceparent", b"tracestate")


def trace_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The W3C trace context among an ASGI call's headers (lower-cased names), or None without a
    traceparent."""
    found = {name.decode(): value.decode("latin-1") for name, value in headers if name in TRACE_HEADERS}
    return found if "traceparent" in found else None


def missing_packages() -> str | None:
    """Why traces cannot be sent from this install, in one line, or None when they can: said at start-up,
    rather than at the first turn."""
    for name in REQUIRED:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            return f"traces need the otel extra ({name} is missing): pip install 'rl-gateway[otel]'"
    return None


class TurnSpans:
    """One span per ended turn, from its record: the record already holds every timing and count, so the
    span is made once the turn is over, with the turn's own start and end, and adds nothing to a call while
    it runs. Spans leave in batches, from a thread of their own, so a slow collector holds up no call."""

    def __init__(self, endpoint: str) -> None:
        missing = missing_packages()
        if missing is not None:
            raise RuntimeError(missing)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE, "service.version": __version__})
        )
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer: Tracer = self._provider.get_tracer("gateway.telemetry", __version__)
        self._propagator = TraceContextTextMapPropagator()

    def record(self, record: TurnRecord) -> None:
        """The turn's span, queued for export (never blocks: a full queue drops the span)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        operation = operation_name(record.endpoint)
        span = self._tracer.start_span(
            f"{operation} {record.model}" if record.model else operation,
            context=self._parent(),
            kind=SpanKind.CLIENT,
            attributes=dict(attributes(record, operation)),
            start_time=nanoseconds(record.started_at),
        )
        if record.status != TurnStatus.OK:
            span.set_status(Status(StatusCode.ERROR, record.error))
        span.end(end_time=nanoseconds(record.finished_at))

    def _parent(self) -> Context | None:
        """The harness's trace context (an invalid traceparent gives none: the span starts a trace)."""
        carrier = incoming.get()
        return None if carrier is None else self._propagator.extract(carrier)

    def shutdown(self) -> None:
        """Send the spans still queued, then stop: the turns of a gateway's last seconds are not lost."""
        self._provider.shutdown()


def operation_name(endpoint: str) -> str:
    """`gen_ai.operation.name`: every dialect but the legacy completions is a chat."""
    return "text_completion" if endpoint == "completions" else "chat"


def nanoseconds(seconds: float) -> int:
    return round(seconds * 1_000_000_000)


def attributes(record: TurnRecord, operation: str) -> Iterator[tuple[str, Any]]:
    """The span's attributes: the conventions' where one fits, the gateway's own under `rl_gateway.`."""
    yield "gen_ai.operation.name", operation
    yield "gen_ai.provider.name", PROVIDER
    yield "gen_ai.conversation.id", record.rollout_id
    if record.model is not None:
        yield "gen_ai.request.model", record.model
    yield "gen_ai.request.stream", record.stream
    yield from _sampling(record.params)
    if record.finish_reason is not None:
        yield "gen_ai.response.finish_reasons", [record.finish_reason]
    if record.response_id is not None:
        yield "gen_ai.response.id", record.response_id
    yield "gen_ai.usage.input_tokens", int(record.prompt_ids.shape[0])
    yield "gen_ai.usage.output_tokens", int(record.completion_ids.shape[0])
    if record.stream and record.first_token_at is not None:
        yield "gen_ai.response.time_to_first_chunk", record.first_token_at - record.started_at
    if record.backend is not None:
        yield from _server(record.backend)
    if record.status != TurnStatus.OK:
        yield "error.type", error_type(record)
    yield from _own(record)


def _sampling(params: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for attribute, fields, kind in _SAMPLING:
        value = next((params[f] for f in fields if params.get(f) is not None), None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield attribute, kind(value)
    stop = params.get("stop")
    if stop:
        yield "gen_ai.request.stop_sequences", [stop] if isinstance(stop, str) else [str(s) for s in stop]
    choices = params.get("n")
    if isinstance(choices, int) and choices != 1:
        yield "gen_ai.request.choice.count", choices


def _server(backend: str) -> Iterator[tuple[str, Any]]:
    """`server.address` and `server.port` of the vLLM server that served the turn (the scheme's port when
    the URL names none)."""
    url = urlsplit(backend)
    if url.hostname:
        yield "server.address", url.hostname
        port = url.port or {"http": 80, "https": 443}.get(url.scheme)
        if port is not None:
            yield "server.port", port


def error_type(record: TurnRecord) -> str:
    """`error.type`, a class of errors a backend can group by: the limit that refused the turn, `cancelled`
    when the agent went away, else the HTTP status the agent got."""
    if record.refused_by is not None:
        return str(record.refused_by)
    if record.status == TurnStatus.CANCELLED:
        return "cancelled"
    return str(record.http_status) if record.http_status is not None else "_OTHER"


def _own(record: TurnRecord) -> Iterator[tuple[str, Any]]:
    yield PREFIX + "endpoint", record.endpoint
    yield PREFIX + "status", str(record.status)
    yield PREFIX + "policy_version", record.policy_version
    if record.policy_version_end is not None:
        yield PREFIX + "policy_version_end", record.policy_version_end
    if record.http_status is not None:
        yield PREFIX + "http_status", record.http_status
    yield PREFIX + "choice_index", record.choice_index
    yield PREFIX + "attempt", record.attempt
    if record.repinned_from is not None:
        yield PREFIX + "repinned_from", record.repinned_from
    if record.splice is not None:
        yield PREFIX + "splice", record.splice
