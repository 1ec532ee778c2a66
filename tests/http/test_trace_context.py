"""A harness's W3C trace context continues into the gateway's span: an agent call that carries `traceparent`
(and `tracestate`) gets a turn span in the harness's trace, child of the harness's span, and sampled as the
harness decided; a call without one, or with one that does not parse, starts a trace of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from support.fake_engine import chat_reply
from support.otlp import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.anyio

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
HARNESS_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{HARNESS_SPAN}-01"


def placed(span: ReceivedSpan) -> tuple[str, str, str, str]:
    """A span's name and place in its trace: trace id, parent span id (empty for a root), trace state."""
    return span.name, span.trace_id, span.parent_span_id, span.trace_state


@pytest.fixture
def collector() -> Iterator[OtlpReceiver]:
    found = OtlpReceiver()
    yield found
    found.close()


@pytest.fixture
async def traced(start, collector, monkeypatch):
    """A gateway that sends its spans to `collector`, in batches a fifth of a second apart."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    gw = await start(otlp_endpoint=collector.url)
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))
    return gw


async def the_span(collector: OtlpReceiver) -> ReceivedSpan:
    """The one span sent (spans leave in the order their turns ended: an earlier one would be here too)."""
    (span,) = await asyncio.to_thread(collector.wait_for, 1)
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

    assert placed(await the_span(collector)) == ("chat tiny", TRACE_ID, HARNESS_SPAN, "harness=run7,other=x")


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

    assert placed(await the_span(collector)) == ("chat tiny", TRACE_ID, HARNESS_SPAN, "")


async def test_without_the_access_log_a_calls_trace_context_still_joins_its_span(
    start, collector, monkeypatch
):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    gw = await start(otlp_endpoint=collector.url, access_log=False)
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))

    await call(gw, {"traceparent": TRACEPARENT})

    assert placed(await the_span(collector)) == ("chat tiny", TRACE_ID, HARNESS_SPAN, "")
