"""How a Responses agent receives vLLM's chat reply: a response object, or the Responses event stream."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from gateway.encoding import dumps
from gateway.responses.items import Event, ResponseShape, ResponseStream, whole_response


def _events(events: list[Event]) -> bytes:
    return b"".join(b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n" for name, data in events)


class ResponsesWire:
    """One call's wire: a whole response, or the state of its event stream."""

    def __init__(self, shape: ResponseShape, model: str | None) -> None:
        self._shape = shape
        self._stream = ResponseStream(shape, model)
        self._started = False

    def reply(self, payload: dict[str, Any]) -> Response:
        return Response(dumps(whole_response(self._shape, payload)), media_type="application/json")

    def chunks(self, chunks: list[dict[str, Any]]) -> bytes:
        events = self._start()
        for chunk in chunks:
            events += self._stream.chunk(chunk)
        return _events(events)

    def done(self) -> bytes:
        return _events(self._start() + self._stream.end())

    def error(self, status: int, message: str, code: str) -> bytes:
        return _events(self._start() + self._stream.error(code, message))

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return self._stream.start()
