"""Incremental server-sent-events parsing: each event's data whatever the chunking, batched per read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from gateway.turns.sse import sse_batches

T = TypeVar("T")

STREAM = b'data: {"a": 1}\n\ndata: {"b": [2, 3]}\n\ndata: [DONE]\n\n'
EVENTS = [b'{"a": 1}', b'{"b": [2, 3]}', b"[DONE]"]


def source(chunks: list[bytes]) -> Callable[[], Awaitable[bytes]]:
    """A reader of `chunks`, one a read, then b"" (the end). Like a socket's, a read gives something or
    ends the stream: empty chunks are not read."""
    reads = iter([chunk for chunk in chunks if chunk])

    async def read() -> bytes:
        return next(reads, b"")

    return read


async def collect(stream: AsyncIterator[T]) -> list[T]:
    return [item async for item in stream]


async def events(chunks: list[bytes]) -> list[bytes]:
    """Every event's data, in order, whatever read completed it."""
    return [data for batch in await collect(sse_batches(source(chunks))) for data in batch]


def data(chunks: list[bytes]) -> list[bytes]:
    return asyncio.run(events(chunks))


def batches(chunks: list[bytes]) -> list[list[bytes]]:
    return asyncio.run(collect(sse_batches(source(chunks))))


def data_of_each(splits: list[list[bytes]]) -> list[list[bytes]]:
    """Many parses in one event loop (one `asyncio.run` each would dominate the run time)."""

    async def main() -> list[list[bytes]]:
        return [await events(chunks) for chunks in splits]

    return asyncio.run(main())


def test_events_in_one_chunk_are_each_yielded():
    assert data([STREAM]) == EVENTS


def test_events_arriving_byte_by_byte_are_reassembled():
    assert data([STREAM[i : i + 1] for i in range(len(STREAM))]) == EVENTS


def test_events_split_at_any_two_points_are_reassembled():
    ends = range(len(STREAM) + 1)
    splits = [[STREAM[:i], STREAM[i:j], STREAM[j:]] for i in ends for j in ends if i <= j]
    results = data_of_each(splits)
    assert len(results) == 1378
    assert all(result == EVENTS for result in results)


def test_events_completed_by_one_read_come_in_one_batch():
    assert batches([STREAM]) == [EVENTS]


def test_each_batch_holds_the_events_its_read_completed():
    chunks = [b"data: 1\n\ndata: 2\n\nda", b"ta: 3\n", b"\n", b"data: 4\n\ndata: 5\n\n"]
    assert batches(chunks) == [[b"1", b"2"], [b"3"], [b"4", b"5"]]


def test_reads_that_complete_no_event_yield_no_batch():
    assert batches([b"data: 1", b"\n", b"\n", b"data: 2\n"]) == [[b"1"]]


def test_byte_by_byte_gives_one_event_per_batch():
    assert batches([STREAM[i : i + 1] for i in range(len(STREAM))]) == [[event] for event in EVENTS]


def test_an_event_of_a_megabyte_over_many_reads_comes_whole_with_the_events_its_last_read_completes():
    ids = b"[" + b",".join(b"%d" % (i % 50000) for i in range(200_000)) + b"]"
    stream = b'data: {"prompt_token_ids": ' + ids + b"}\n\ndata: 2\n\ndata: 3\n"
    reads = [stream[i : i + 4096] for i in range(0, len(stream), 4096)]
    assert batches(reads) == [[b'{"prompt_token_ids": ' + ids + b"}", b"2"]]


def test_an_event_end_split_between_two_reads_is_found():
    assert batches([b"data: 1\n", b"\ndata: 2\n", b"\n"]) == [[b"1"], [b"2"]]


def test_crlf_line_endings_are_accepted_even_split_between_reads():
    assert data([b"data: 1\r\n\r\ndata: 2\r", b"\n\r", b"\n"]) == [b"1", b"2"]


def test_comments_and_other_fields_are_ignored():
    stream = b": keep-alive\n\nevent: message\nid: 7\ndata: {}\nretry: 10\n\n: ping\n\n"
    assert data([stream]) == [b"{}"]
    assert batches([b": ping\n\n", b"data: 1\n\n"]) == [[b"1"]]


def test_empty_lines_between_events_are_ignored():
    assert data([b"\n\ndata: 1\n\n\n\n\n\ndata: 2\n\n"]) == [b"1", b"2"]


def test_data_lines_of_one_event_are_joined_by_newlines():
    assert data([b"data: first\ndata: second\n\n"]) == [b"first\nsecond"]


def test_the_space_after_the_colon_is_optional():
    assert data([b"data:{}\n\ndata: {}\n\n"]) == [b"{}", b"{}"]


def test_done_is_passed_on_as_data():
    assert data([b"data: [DONE]\n\n"]) == [b"[DONE]"]


def test_an_unterminated_last_event_is_dropped():
    assert data([b"data: 1\n\ndata: 2\n"]) == [b"1"]


def test_no_chunks_give_no_events():
    assert data([]) == []
