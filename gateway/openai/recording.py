"""A turn's trip to the backend and its recording: the request sent, the outcome stored (ok, error or
cancelled) with its policy versions, the stream closed once the turn is committed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.backend import BackendReply, BackendStreamError
from gateway.encoding import dumps
from gateway.errors import ApiError, error_body
from gateway.openai.capture import TurnCapture
from gateway.state import GatewayState
from gateway.store.records import StoreError, TurnRecord
from gateway.store.status import TurnStatus

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_CONTEXT_TOO_LONG = ("maximum context length", "longer than the maximum model length")
"""How vLLM words a prompt that does not fit the model's context."""


async def send_upstream(
    state: GatewayState, capture: TurnCapture, upstream: dict[str, Any], path: str | None = None
) -> BackendReply:
    """Send to a backend; on failure store an error turn and raise the agent-facing error."""
    record = capture.record
    try:
        record.backend, reply = await state.backends.send(
            record.rollout_id, path or capture.path, dumps(upstream)
        )
    except ApiError as exc:
        await store_error_turn(state, capture, exc.status_code, exc.message)
        raise
    if reply.status != 200:
        try:
            content = await reply.body()
        except BackendStreamError:
            content = b""
        error = backend_error(reply.status, content)
        await store_error_turn(state, capture, error.status_code, error.message)
        raise error
    return reply


async def post_json(
    state: GatewayState, capture: TurnCapture, body: dict[str, Any], path: str
) -> dict[str, Any]:
    """A whole JSON exchange with the rollout's backend (render, generate, derender, tokenize)."""
    reply = await send_upstream(state, capture, body, path)
    try:
        answer = orjson.loads(await reply.body())
    except (BackendStreamError, orjson.JSONDecodeError) as exc:
        message = (
            str(exc)
            if isinstance(exc, BackendStreamError)
            else f"backend sent a reply to {path} that is not JSON"
        )
        await store_error_turn(state, capture, 502, message)
        raise ApiError(502, message, "backend_error") from None
    if not isinstance(answer, dict):
        await store_error_turn(state, capture, 502, f"backend sent an unexpected reply to {path}")
        raise ApiError(502, f"backend sent an unexpected reply to {path}", "backend_error")
    return answer


def backend_error(status: int, content: bytes) -> ApiError:
    """The agent-facing error for a backend's non-200 answer: its own 4xx as vLLM wrote it (message, type,
    param), a prompt too long for the model as `context_length_exceeded`, anything else a 502."""
    if status in (401, 403):
        return ApiError(
            502,
            f"backend refused the gateway's credentials (HTTP {status}): check --backend-api-key",
            "backend_error",
        )
    detail = _error_detail(content)
    message = str(detail.get("message") or f"backend answered HTTP {status}")
    if status >= 500:
        return ApiError(502, message, "backend_error")
    if any(phrase in message for phrase in _CONTEXT_TOO_LONG):
        return ApiError(400, message, "context_length_exceeded", detail.get("param"), detail.get("type"))
    code = detail.get("code")
    return ApiError(
        status,
        message,
        code if isinstance(code, str | int) else "invalid_request",
        detail.get("param") if isinstance(detail.get("param"), str) else None,
        detail.get("type") if isinstance(detail.get("type"), str) else None,
    )


def _error_detail(content: bytes) -> dict[str, Any]:
    """vLLM's `{"error": {...}}` (or an older flat `{"message", ...}`); text otherwise."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {"message": content[:500].decode("utf-8", "replace") or None}
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return error
        if "message" in payload:
            return payload
    return {}


def backend_message(content: bytes) -> str | None:
    message = _error_detail(content).get("message")
    return str(message) if message is not None else None


async def store_error_turn(state: GatewayState, capture: TurnCapture, status: int, message: str) -> None:
    records = capture.finish()
    for record in records:
        record.policy_version_end = state.policy_version
        record.status = TurnStatus.ERROR
        record.http_status = status
        record.error = message
        record.finished_at = time.time()
        account(state, record, status)
    state.metrics.errors.labels(reason=str(status)).inc()
    await state.store.writer.insert_turns(records)


def account(state: GatewayState, record: TurnRecord, status: int) -> None:
    metrics = state.metrics
    metrics.requests.labels(endpoint=record.endpoint, status=str(status)).inc()
    metrics.latency.labels(endpoint=record.endpoint).observe(record.finished_at - record.started_at)
    metrics.tokens.labels(kind="prompt").inc(record.prompt_ids.shape[0])
    metrics.tokens.labels(kind="completion").inc(record.completion_ids.shape[0])


async def commit_turn(state: GatewayState, records: list[TurnRecord]) -> None:
    """Commit a call's turns (one per choice) together."""
    for record in records:
        record.policy_version_end = state.policy_version
    try:
        await state.store.writer.insert_turns(records)
    except StoreError:
        raise
    except Exception as exc:
        log.exception("could not commit turn of rollout %s", records[0].rollout_id)
        raise ApiError(
            503, f"the turn could not be stored: {type(exc).__name__}", "store_unavailable"
        ) from exc
    for record in records:
        account(state, record, 200)


class StreamFailure(Exception):
    """A streamed reply broke off; `stored` when its error turn was already recorded where it happened."""

    def __init__(self, message: str, *, stored: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.stored = stored


async def relay_turn(
    state: GatewayState, capture: TurnCapture, reply: BackendReply, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """The frame of every streamed turn: pass the agent's chunks on as they come; a client that leaves
    leaves a cancelled turn, a failing backend an error turn and an error event; otherwise the turn is
    committed, then the final [DONE] is sent."""
    try:
        async for chunk in chunks:
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        record_cancelled(state, capture)
        raise
    except StreamFailure as exc:
        if not exc.stored:
            await store_error_turn(state, capture, 502, exc.message)
        yield stream_error(502, exc.message, "backend_error")
        return
    finally:
        reply.close()
    async for tail in end_of_stream(state, capture):
        yield tail


def stream_error(status: int, message: str, code: str) -> bytes:
    """An OpenAI-format error event, then the end of the stream."""
    return b"data: " + error_body(status, message, code) + b"\n\n" + DONE


async def end_of_stream(state: GatewayState, capture: TurnCapture) -> AsyncIterator[bytes]:
    """Commit the streamed turn, then release the final [DONE] (or an error event if it could not be stored)."""
    records = capture.finish()
    for record in records:
        record.finished_at = time.time()
        record.http_status = 200
    try:
        await commit_turn(state, records)
    except (ApiError, StoreError) as exc:
        yield stream_error(exc.status_code, exc.message, "store_error")
        return
    yield DONE


def record_cancelled(state: GatewayState, capture: TurnCapture) -> None:
    """The agent went away: store what was generated, without awaiting (this task is being cancelled)."""
    records = capture.finish()
    for record in records:
        record.status = TurnStatus.CANCELLED
        record.policy_version_end = state.policy_version
        record.error = "client disconnected before the end of the stream"
        record.finished_at = time.time()
        account(state, record, 499)
    state.metrics.errors.labels(reason="cancelled").inc()
    state.store.writer.enqueue_turns(records).add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("could not store a cancelled turn: %s", future.exception())
