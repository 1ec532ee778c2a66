"""Incremental server-sent-events parsing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable


async def sse_batches(read: Callable[[], Awaitable[bytes]]) -> AsyncIterator[list[bytes]]:
    """The `data` of the events each network read (`read`, b"" at the end) completes, together: a reader
    that falls behind gets everything that has arrived at once.

    An event arriving over many reads (the first event of a long prompt holds all its ids: megabytes) is
    kept in pieces and joined once it is complete; joining and rescanning it at every read would cost the
    square of its size."""
    pending: list[bytes] = []
    """The start of an event not yet complete, as read."""
    while chunk := await read():
        if b"\r" in chunk or (pending and pending[-1].endswith(b"\r")):
            chunk = b"".join([*pending, chunk]).replace(b"\r\n", b"\n")
            pending = []
        if b"\n\n" not in chunk and not (pending and pending[-1].endswith(b"\n") and chunk.startswith(b"\n")):
            pending.append(chunk)
            continue
        events = (b"".join([*pending, chunk]) if pending else chunk).split(b"\n\n")
        rest = events.pop()
        pending = [rest] if rest else []
        batch = _data_of(events)
        if batch:
            yield batch


def _data_of(events: list[bytes]) -> list[bytes]:
    """Each event's data. vLLM's events are one `data: ` line each: those are read in one pass."""
    if all(event.startswith(b"data: ") and b"\n" not in event for event in events):
        return [event[6:] for event in events]
    batch = []
    for event in events:
        data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            batch.append(b"\n".join(data))
    return batch
