"""Incremental server-sent-events parsing."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The `data` of the events each network read completes, together: a reader that falls behind gets
    everything that has arrived at once."""
    buffer = b""
    async for chunk in chunks:
        buffer = buffer + chunk if buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
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
        buffer = buffer[start:]
        if batch:
            yield batch
