"""Forwarding one agent call to vLLM (pass-through, or exact mode in `exact.py`), whole or streamed.

The turn is committed before the reply is released (`recording.py`): a non-streamed reply is sent after the commit, a
streamed one passes every chunk through as it arrives and sends its final `data: [DONE]` after the commit.
A client that goes away mid-stream leaves a turn marked cancelled with what had been generated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from gateway.backend import BackendReply, BackendStreamError
from gateway.errors import ApiError
from gateway.openai.capture import Asked, ChatCapture, TurnCapture
from gateway.openai.exact import forward_exact
from gateway.openai.exact_stream import forward_exact_stream
from gateway.openai.recording import (
    StreamFailure,
    backend_message,
    commit_turn,
    relay_turn,
    send_upstream,
    store_error_turn,
)
from gateway.openai.sse import sse_data
from gateway.state import GatewayState
from gateway.store import schema
from gateway.store.records import RolloutState, TurnRecord

log = logging.getLogger(__name__)


async def check_rollout(state: GatewayState, rollout_id: str) -> RolloutState | None:
    """Refuse calls that will not be recorded before spending engine time on them.

    Without registration required, a rollout this process has not seen is not looked up: the store creates
    it, or refuses the turn at commit if it turns out to be finished.
    """
    if state.settings.require_registered_rollouts:
        rollout = await state.store.rollout_state(rollout_id)
    else:
        rollout = state.store.writer.rollouts.get(rollout_id)
    if rollout is None and state.settings.require_registered_rollouts:
        raise ApiError(404, f"rollout {rollout_id!r} is not registered", "rollout_not_found")
    if rollout is not None and rollout.status != schema.ROLLOUT_RUNNING:
        raise ApiError(409, f"rollout {rollout_id!r} is already {rollout.status}", "rollout_finished")
    return rollout


def new_record(state: GatewayState, rollout_id: str, capture_cls: type[TurnCapture], body: dict[str, Any]) -> TurnRecord:
    fields = capture_cls.request_fields(body)
    return TurnRecord(
        rollout_id=rollout_id,
        endpoint=capture_cls.endpoint,
        model=body.get("model"),
        stream=bool(body.get("stream")),
        policy_version=state.policy_version,
        started_at=time.time(),
        messages=body.get("messages"),
        prompt_text=body["prompt"] if isinstance(body.get("prompt"), str) else None,
        tools=fields["tools"],
        params=fields["params"],
    )


async def forward(
    state: GatewayState, rollout_id: str, capture_cls: type[TurnCapture], body: dict[str, Any]
) -> Response:
    rollout = await check_rollout(state, rollout_id)
    await state.traffic.enter()
    state.metrics.in_flight.inc()
    streaming = False
    try:
        capture = capture_cls(new_record(state, rollout_id, capture_cls, body))
        upstream, asked = capture.inject(body)
        mode = (rollout.mode if rollout is not None else None) or state.settings.mode
        if mode == "exact" and isinstance(capture, ChatCapture) and await state.backends.exact_capable(rollout_id):
            exact = forward_exact_stream if capture.record.stream else forward_exact
            response = await exact(state, capture, body, asked)
        elif capture.record.stream:
            response = await _forward_stream(state, capture, upstream, asked)
        else:
            response = await _forward_whole(state, capture, upstream, asked)
        if isinstance(response, StreamingResponse):
            response.body_iterator = _counted(state, response.body_iterator)
            streaming = True
        return response
    finally:
        if not streaming:
            _leave(state)


async def _counted(state: GatewayState, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A streamed call is in flight until its last byte (or its client leaves)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        _leave(state)


def _leave(state: GatewayState) -> None:
    state.traffic.leave()
    state.metrics.in_flight.dec()


async def _forward_whole(
    state: GatewayState, capture: TurnCapture, upstream: dict[str, Any], asked: Asked
) -> Response:
    reply = await send_upstream(state, capture, upstream)
    try:
        payload = orjson.loads(await reply.body())
    except (BackendStreamError, orjson.JSONDecodeError) as exc:
        message = str(exc) if isinstance(exc, BackendStreamError) else "backend sent a reply that is not JSON"
        await store_error_turn(state, capture, 502, message)
        raise ApiError(502, message, "backend_error") from None
    capture.feed(payload)
    record = capture.finish()
    record.finished_at = record.first_token_at = time.time()
    record.http_status = 200
    capture.strip(payload, asked)
    await commit_turn(state, record)
    return Response(orjson.dumps(payload), media_type="application/json")


async def _forward_stream(
    state: GatewayState, capture: TurnCapture, upstream: dict[str, Any], asked: Asked
) -> Response:
    reply = await send_upstream(state, capture, upstream)
    chunks = _chunks(capture, reply, asked)
    return StreamingResponse(relay_turn(state, capture, reply, chunks), media_type="text/event-stream")


async def _chunks(capture: TurnCapture, reply: BackendReply, asked: Asked) -> AsyncIterator[bytes]:
    """vLLM's chunks as they arrive, captured, then stripped of what the gateway injected."""
    record = capture.record
    try:
        async for data in sse_data(reply.chunks()):
            if data == b"[DONE]":
                return
            chunk = orjson.loads(data)
            if record.first_token_at is None:
                record.first_token_at = time.time()
            if "error" in chunk and "choices" not in chunk:
                raise StreamFailure(backend_message(data) or "backend stream failed")
            capture.feed(chunk)
            capture.strip(chunk, asked)
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    except BackendStreamError as exc:
        raise StreamFailure(str(exc)) from exc
    except orjson.JSONDecodeError as exc:
        raise StreamFailure(f"backend sent a chunk that is not JSON: {exc}") from exc
    raise StreamFailure("backend stream ended without [DONE]")
