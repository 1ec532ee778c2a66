"""Forwarding one agent call to vLLM (pass-through, or exact mode in `exact.py`), whole or streamed.

The turn is committed before the reply is released (`recording.py`): a non-streamed reply is sent after the
commit, a streamed one passes every chunk through as it arrives and sends its final `data: [DONE]` after the
commit. A client that goes away mid-stream leaves a turn marked cancelled with what had been generated.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from gateway.backend import BackendReply, BackendStreamError
from gateway.encoding import dumps
from gateway.errors import ApiError
from gateway.openai.admission import (
    cap_reply,
    check_context_limit,
    check_turn_limit,
    limits_of,
    prompt_tokens,
)
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
from gateway.store.status import Mode
from gateway.store.records import RolloutState, TurnRecord


@dataclass(frozen=True)
class AgentCall:
    """An agent's request: the body as sent, its validated reading, and what identifies a client's retry."""

    body: dict[str, Any]
    parsed: BaseModel
    request_hash: str
    attempt: int

    @property
    def stream(self) -> bool:
        return bool(getattr(self.parsed, "stream", False))

    @property
    def choices(self) -> int:
        return getattr(self.parsed, "n", None) or 1


def new_record(
    state: GatewayState, rollout_id: str, capture_cls: type[TurnCapture], call: AgentCall
) -> TurnRecord:
    body = call.body
    fields = capture_cls.request_fields(body)
    return TurnRecord(
        rollout_id=rollout_id,
        endpoint=capture_cls.endpoint,
        model=body.get("model"),
        stream=call.stream,
        policy_version=state.policy_version,
        started_at=time.time(),
        messages=body.get("messages"),
        prompt_text=body["prompt"] if isinstance(body.get("prompt"), str) else None,
        tools=fields["tools"],
        params=fields["params"],
        request_hash=call.request_hash,
        attempt=call.attempt,
    )


async def forward(
    state: GatewayState,
    rollout_id: str,
    rollout: RolloutState | None,
    capture_cls: type[TurnCapture],
    call: AgentCall,
) -> Response:
    await state.traffic.enter()
    state.metrics.in_flight.inc()
    streaming = False
    try:
        capture = capture_cls(new_record(state, rollout_id, capture_cls, call))
        await check_turn_limit(state, capture, rollout)
        upstream, asked = capture.inject(call.body, call.parsed)
        mode = (rollout.mode if rollout is not None else None) or state.settings.mode
        exact = (
            mode == Mode.EXACT
            and isinstance(capture, ChatCapture)
            and call.choices == 1
            and await state.backends.exact_capable(rollout_id)
        )
        if exact:
            forward_exact_mode = forward_exact_stream if call.stream else forward_exact
            response = await forward_exact_mode(state, capture, call.body, asked, limits_of(state, rollout))
        else:
            context = limits_of(state, rollout).max_context_tokens
            if context is not None:
                room = await check_context_limit(
                    state, capture, await prompt_tokens(state, capture, call.body), context
                )
                cap_reply(upstream, room)
            if call.stream:
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
    records = capture.finish()
    for record in records:
        record.finished_at = record.first_token_at = time.time()
        record.http_status = 200
    capture.strip(payload, asked)
    await commit_turn(state, records)
    return Response(dumps(payload), media_type="application/json")


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
            yield b"data: " + dumps(chunk) + b"\n\n"
    except BackendStreamError as exc:
        raise StreamFailure(str(exc)) from exc
    except orjson.JSONDecodeError as exc:
        raise StreamFailure(f"backend sent a chunk that is not JSON: {exc}") from exc
    raise StreamFailure("backend stream ended without [DONE]")
