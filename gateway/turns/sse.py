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
        buffer = b"".join([*pending, chunk]) if pending else chunk
        end = buffer.rfind(b"\n\n") + 2
        pending = [buffer[end:]] if end < len(buffer) else []
        batch = _data_of(buffer, end)
        if batch:
            yield batch


def _data_of(buffer: bytes, end: int) -> list[bytes]:
    """The data of the events `buffer[:end]` holds. vLLM's events are one `data: ` line each: when every
    line feed is one of the blank lines that end them, the buffer is split at them in one pass."""
    events = buffer.count(b"\n\ndata: ", 0, end) + 1
    if buffer.startswith(b"data: ") and buffer.count(b"\n", 0, end) == 2 * events:
        return buffer[6 : end - 2].split(b"\n\ndata: ")
    batch = []
    for event in buffer[:end].split(b"\n\n"):
        data = [_value(line) for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            batch.append(b"\n".join(data))
    return batch


def _value(line: bytes) -> bytes:
    """A `data:` line's value: what follows the colon, less one space if one follows it."""
    return line[6:] if line.startswith(b"data: ") else line[5:]
