"""Incremental server-sent-events parsing."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The `data` of the events each network read completes, together: a reader that falls behind gets
    everything that has arrived at once."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        batch = []
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                batch.append(b"\n".join(data))
        if batch:
            yield batch
