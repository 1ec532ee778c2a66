"""Incremental server-sent-events parsing."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The `data` of the events each network read completes, together: a reader that falls behind gets
    everything that has arrived at once.

    An event arriving over many reads (the first event of a long prompt holds all its ids: megabytes) is
    kept in pieces and joined once it is complete; joining and rescanning it at every read would cost the
    square of its size."""
    pending: list[bytes] = []
    """The start of an event not yet complete, as read."""
    async for chunk in chunks:
        if not chunk:
            continue
        if b"\r" in chunk or (pending and pending[-1].endswith(b"\r")):
            chunk = b"".join([*pending, chunk]).replace(b"\r\n", b"\n")
            pending = []
        if b"\n\n" not in chunk and not (pending and pending[-1].endswith(b"\n") and chunk.startswith(b"\n")):
            pending.append(chunk)
            continue
        buffer = b"".join([*pending, chunk]) if pending else chunk
        batch = []
        start = 0  # events are read in place: cutting each off the buffer would copy the rest every time
        while (end := buffer.find(b"\n\n", start)) >= 0:
            event = buffer[start:end]
            start = end + 2
            if event.startswith(b"data:") and b"\n" not in event:  # vLLM's events: one data line each
                batch.append(event[5:].lstrip(b" "))
                continue
            data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                batch.append(b"\n".join(data))
        pending = [buffer[start:]] if start < len(buffer) else []
        if batch:
            yield batch
