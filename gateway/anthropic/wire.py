"""How a Messages agent receives vLLM's chat reply: a Messages object, or the Messages event stream."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from gateway.anthropic.translate import StreamTranslator, message
from gateway.encoding import dumps


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class AnthropicWire:
    """One call's wire: a whole reply, or the state of its event stream."""

    def __init__(self) -> None:
        self._stream = StreamTranslator()

    def reply(self, payload: dict[str, Any]) -> Response:
        return Response(dumps(message(payload)), media_type="application/json")

    def chunks(self, chunks: list[dict[str, Any]]) -> bytes:
        return b"".join(event(name, data) for chunk in chunks for name, data in self._stream.chunk(chunk))

    def done(self) -> bytes:
        return b"".join(event(name, data) for name, data in self._stream.end())

    def error(self, status: int, message: str, code: str) -> bytes:
        kind = "invalid_request_error" if status < 500 else "api_error"
        return event("error", {"type": "error", "error": {"type": kind, "message": message}})
