"""How a dialect writes the engine's reply for its agents: the seam between the shared core and a wire format.

The core captures and records vLLM's chat or completions reply (whole payloads and stream chunks, as vLLM
writes them); a dialect's `Wire` turns each into the bytes its agents expect, and frames the end of a stream
and a failure in the middle of one. A wire is made per call, so it can carry the state of a stream.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from starlette.responses import Response

from gateway.encoding import dumps
from gateway.errors import error_body


class Wire(Protocol):
    def reply(self, payload: dict[str, Any]) -> Response:
        """A whole reply."""
        ...

    def chunks(self, chunks: list[dict[str, Any]]) -> bytes:
        """Stream chunks that arrived together, in one write."""
        ...

    def done(self) -> bytes:
        """The end of a stream, sent once its turn is committed."""
        ...

    def error(self, status: int, message: str, code: str) -> bytes:
        """A failure in the middle of a stream, and its end."""
        ...


DONE = b"data: [DONE]\n\n"


class OpenAIWire:
    """vLLM's own format: the agent receives what vLLM sent, minus what the gateway asked for itself."""

    def reply(self, payload: dict[str, Any]) -> Response:
        return Response(dumps(payload), media_type="application/json")

    def chunks(self, chunks: list[dict[str, Any]]) -> bytes:
        # Chunks orjson parsed hold only text keys and no numpy values: plain orjson, without the options
        # `dumps` pays for in time (40% of a chunk's encoding).
        return b"data: " + b"\n\ndata: ".join([orjson.dumps(chunk) for chunk in chunks]) + b"\n\n"

    def done(self) -> bytes:
        return DONE

    def error(self, status: int, message: str, code: str) -> bytes:
        return b"data: " + error_body(status, message, code) + b"\n\n" + DONE
