"""Each dialect's stream wire: chunks that arrive together are written in one piece, byte for byte what the
agent would get had they come one at a time."""

from __future__ import annotations

from typing import Any

import orjson
from test_sse import data

from gateway.anthropic.wire import AnthropicWire
from gateway.responses.items import ResponseShape
from gateway.responses.translate import ToolNames
from gateway.responses.wire import ResponsesWire
from gateway.turns.wire import OpenAIWire, Wire


def delta(piece: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish_reason, "token_ids": None}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "tiny",
        "choices": [choice],
    }


CHUNKS = [
    delta({"role": "assistant", "content": ""}),
    delta({"content": "Hel"}),
    delta({"content": "lo é"}),
    delta({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "ls"}}]}),
    delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "/"}'}}]}),
    delta({}, finish_reason="tool_calls"),
]
"""A streamed reply with text and a tool call, as the relay passes it on (stripped of ids and logprobs)."""


def responses_wire() -> ResponsesWire:
    shape = ResponseShape("resp_1", {"model": "tiny", "input": "hi"}, ToolNames(), 7.0)
    return ResponsesWire(shape, "tiny")


def one_at_a_time(wire: Wire) -> bytes:
    return b"".join(wire.chunks([chunk]) for chunk in CHUNKS) + wire.done()


def together(wire: Wire, *sizes: int) -> bytes:
    """The same chunks in batches of `sizes`."""
    written, start = [], 0
    for size in sizes:
        written.append(wire.chunks(CHUNKS[start : start + size]))
        start += size
    assert start == len(CHUNKS)
    return b"".join(written) + wire.done()


def test_openai_chunks_written_together_are_one_event_each_as_vllm_sent_them():
    written = OpenAIWire().chunks(CHUNKS)
    assert written == b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in CHUNKS)
    assert [orjson.loads(event) for event in data([written])] == CHUNKS


def test_openai_chunks_written_together_are_the_bytes_of_one_at_a_time():
    assert together(OpenAIWire(), 2, 4) == one_at_a_time(OpenAIWire())


def test_anthropic_events_of_chunks_written_together_are_the_bytes_of_one_at_a_time():
    assert together(AnthropicWire(), 3, 1, 2) == one_at_a_time(AnthropicWire())
    assert together(AnthropicWire(), 6) == one_at_a_time(AnthropicWire())


def test_responses_events_of_chunks_written_together_are_the_bytes_of_one_at_a_time():
    assert together(responses_wire(), 1, 5) == one_at_a_time(responses_wire())
    assert together(responses_wire(), 6) == one_at_a_time(responses_wire())


def test_the_responses_stream_starts_once_however_its_chunks_are_batched():
    written = together(responses_wire(), 2, 2, 2)
    assert written.count(b"event: response.created\n") == 1
    assert written.startswith(b"event: response.created\n")
