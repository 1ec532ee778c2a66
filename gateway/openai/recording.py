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
from gateway.errors import ApiError, error_body
from gateway.openai.capture import TurnCapture
from gateway.state import GatewayState
from gateway.store import schema
from gateway.store.records import StoreError, TurnRecord

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


async def send_upstream(
    state: GatewayState, capture: TurnCapture, upstream: dict[str, Any], path: str | None = None
) -> BackendReply:
    """Send to a backend; on failure store an error turn and raise the agent-facing error."""
    record = capture.record
    try:
        record.backend, reply = await state.backends.send(
            record.rollout_id, path or capture.path, orjson.dumps(upstream)
        )
    except ApiError as exc:
        await store_error_turn(state, capture, exc.status_code, exc.message)
        raise
    if reply.status != 200:
        try:
            content = await reply.body()
        except BackendStreamError:
            content = b""
        message = backend_message(content) or f"backend answered HTTP {reply.status}"
        status = reply.status if reply.status < 500 else 502
        await store_error_turn(state, capture, status, message)
        raise ApiError(status, message, "backend_error" if status >= 500 else "invalid_request")
    return reply


def backend_message(content: bytes) -> str | None:
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:500].decode("utf-8", "replace") or None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    if isinstance(payload, dict) and "message" in payload:
        return str(payload["message"])
    return None


async def store_error_turn(state: GatewayState, capture: TurnCapture, status: int, message: str) -> None:
    record = capture.finish()
    record.policy_version_end = state.policy_version
    record.status = schema.TURN_ERROR
    record.http_status = status
    record.error = message
    record.finished_at = time.time()
    state.metrics.errors.labels(reason=str(status)).inc()
    _account(state, record, status)
    await state.store.writer.insert_turn(record)


def _account(state: GatewayState, record: TurnRecord, status: int) -> None:
    metrics = state.metrics
    metrics.requests.labels(endpoint=record.endpoint, status=str(status)).inc()
    metrics.latency.labels(endpoint=record.endpoint).observe(record.finished_at - record.started_at)
    metrics.tokens.labels(kind="prompt").inc(record.prompt_ids.shape[0])
    metrics.tokens.labels(kind="completion").inc(record.completion_ids.shape[0])


async def commit_turn(state: GatewayState, record: TurnRecord) -> None:
    record.policy_version_end = state.policy_version
    try:
        await state.store.writer.insert_turn(record)
    except StoreError:
        raise
    except Exception as exc:
        log.exception("could not commit turn of rollout %s", record.rollout_id)
        raise ApiError(503, f"the turn could not be stored: {type(exc).__name__}", "store_unavailable") from exc
    _account(state, record, 200)


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
    record = capture.finish()
    record.finished_at = time.time()
    record.http_status = 200
    try:
        await commit_turn(state, record)
    except (ApiError, StoreError) as exc:
        yield stream_error(exc.status_code, exc.message, "store_error")
        return
    yield DONE


def record_cancelled(state: GatewayState, capture: TurnCapture) -> None:
    """The agent went away: store what was generated, without awaiting (this task is being cancelled)."""
    record = capture.finish()
    record.status = schema.TURN_CANCELLED
    record.policy_version_end = state.policy_version
    record.error = "client disconnected before the end of the stream"
    record.finished_at = time.time()
    state.metrics.errors.labels(reason="cancelled").inc()
    _account(state, record, 499)
    state.store.writer.enqueue_turn(record).add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("could not store a cancelled turn: %s", future.exception())
