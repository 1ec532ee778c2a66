"""A turn's requests to its rollout's backend. Failures are raised as the agent-facing `ApiError`; the turn's
error record is written once, by `forward`, whatever step failed."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.encoding import dumps
from gateway.errors import ApiError, backend_answer, backend_failure
from gateway.fleet.pool import BackendPool
from gateway.fleet.replies import BackendFailure, BackendReply, BackendStreamError
from gateway.turns.capture import TurnCapture


async def send(
    backends: BackendPool, capture: TurnCapture, body: dict[str, Any], path: str | None = None
) -> BackendReply:
    """POST to the rollout's backend; an answer other than 200 is raised as the agent's error."""
    record = capture.record
    try:
        routed = await backends.send(record.rollout_id, path or capture.path, dumps(body), record.model)
        record.backend, reply = routed.url, routed.reply
        record.repinned_from = record.repinned_from or routed.repinned_from
    except BackendFailure as exc:
        record.backend = exc.url or record.backend
        raise backend_failure(exc) from None
    if reply.status != 200:
        try:
            content = await reply.body()
        except BackendStreamError:
            content = b""
        raise backend_answer(reply.status, content)
    return reply


async def read_json(reply: BackendReply, what: str = "a reply") -> Any:
    """A whole reply's JSON; a reply that breaks off or is not JSON is a 502."""
    try:
        return orjson.loads(await reply.body())
    except BackendStreamError as exc:
        raise ApiError(502, str(exc), "backend_error") from None
    except orjson.JSONDecodeError:
        raise ApiError(502, f"backend sent {what} that is not JSON", "backend_error") from None


async def post_json(
    backends: BackendPool, capture: TurnCapture, body: dict[str, Any], path: str
) -> dict[str, Any]:
    """A whole JSON exchange with the rollout's backend (render, generate, derender, tokenize)."""
    answer = await read_json(await send(backends, capture, body, path), f"a reply to {path}")
    if not isinstance(answer, dict):
        raise ApiError(502, f"backend sent an unexpected reply to {path}", "backend_error")
    return answer
