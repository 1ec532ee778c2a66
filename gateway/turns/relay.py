"""The frame of every streamed turn: chunks pass through as they come; the turn is committed before the
stream's end is sent; a client that leaves leaves a cancelled turn, a failing backend an error turn."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Send

from gateway.errors import ApiError, store_failure
from gateway.fleet.replies import BackendReply
from gateway.store.records import StoreError
from gateway.turns.capture import TurnCapture
from gateway.turns.recording import Recorder
from gateway.turns.wire import Wire


class StreamFailure(Exception):
    """A streamed reply broke off after its first byte went out."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RelayResponse(StreamingResponse):
    """A streamed reply that stops at its next chunk once the client has left, and says when it has ended.

    Starlette cancels the stream when its client leaves, but anyio cancels a task only when it finds it
    waiting on a future not yet done: a relay that finds the engine's next output already arrived each time
    it looks (an engine outpacing a busy gateway) was not cancelled, and relayed the rest of a long reply
    to nobody, engine time included, then stored the turn as answered.

    The chunks are written here, not through layers of generators around the relay: each layer costs every
    chunk of every stream a switch."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], ended: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self._chunks = chunks
        self._ended = ended
        """Called once the stream is over, however it ended (the call is no longer in flight)."""
        self._client_left = False

    async def listen_for_disconnect(self, receive: Receive) -> None:
        await super().listen_for_disconnect(receive)
        self._client_left = True

    async def stream_response(self, send: Send) -> None:
        try:
            async with contextlib.aclosing(self._chunks):  # closing the relay stores the turn as cancelled
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for chunk in self._chunks:
                    if self._client_left:
                        return
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._ended()


async def relay(
    recorder: Recorder, capture: TurnCapture, reply: BackendReply, chunks: AsyncIterator[bytes], wire: Wire
) -> AsyncGenerator[bytes, None]:
    version = recorder.policy_version
    try:
        async for chunk in chunks:
            # The version in effect when the engine's last output arrived, not when the turn commits: a turn
            # vLLM aborted for a weight update ended under the old weights, however late it is recorded.
            version = recorder.policy_version
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        recorder.cancelled(capture)
        raise
    except StreamFailure as exc:
        await recorder.failed(capture, 502, exc.message)
        yield wire.error(502, exc.message, "backend_error")
        return
    finally:
        reply.close()
    records = capture.finish()
    for record in records:
        record.finished_at = time.time()
        record.http_status = 200
        if record.adapter is None:  # an adapter version's weights never change
            record.policy_version_end = version
    try:
        await recorder.commit(records)
    except (ApiError, StoreError) as exc:
        error = store_failure(exc) if isinstance(exc, StoreError) else exc
        yield wire.error(error.status_code, error.message, "store_error")
        return
    yield wire.done()
