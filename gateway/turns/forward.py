"""Forwarding one agent call to vLLM, whole or streamed: as the agent sent it (pass-through), or with its
prompt given as exact ids (exact mode, `exact.py`).

The turn is committed before the reply is released: a whole reply is sent after the commit, a streamed one
passes every chunk through as it arrives and sends its end after the commit (`relay.py`). Whatever step
fails before the reply starts, the turn is stored once, here: refused by a limit, or an error.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

import orjson
from starlette.responses import Response

from gateway.errors import ApiError, StoreUnavailable, backend_error_detail
from gateway.fleet.leaders import Ahead
from gateway.fleet.replies import BackendReply, BackendStreamError
from gateway.store.records import RolloutState, TurnRecord
from gateway.turns.adapters import live_version
from gateway.turns.admission import Refusal, cap_reply, check_context_limit, check_turn_limit, limits_of
from gateway.turns.admission import prompt_tokens as count_prompt
from gateway.turns.capture import Asked, ChatCapture, TurnCapture
from gateway.turns.context import TurnContext
from gateway.turns.exact import exact_prompt, with_prompt
from gateway.turns.intake import AgentCall
from gateway.turns.recording import Recorder
from gateway.turns.relay import RelayResponse, StreamFailure, relay
from gateway.turns.sampling import imposed, merged
from gateway.turns.sse import sse_batches
from gateway.turns.upstream import ahead_of, send
from gateway.turns.wire import Wire
from rollout_store.status import Mode


def new_record(ctx: TurnContext, capture_cls: type[TurnCapture], call: AgentCall) -> TurnRecord:
    body = call.body
    fields = capture_cls.request_fields(body)
    return TurnRecord(
        rollout_id=call.arrival.rollout_id,
        endpoint=call.dialect or capture_cls.endpoint,
        model=body.get("model"),
        stream=call.stream,
        policy_version=ctx.recorder.policy_version,
        started_at=time.time(),
        messages=body.get("messages"),
        prompt_text=body["prompt"] if isinstance(body.get("prompt"), str) else None,
        tools=fields["tools"],
        params=fields["params"],
        request_hash=call.request_hash,
        attempt=call.attempt,
        request=call.original,
        response_id=call.response_id,
    )


async def forward(ctx: TurnContext, capture_cls: type[TurnCapture], call: AgentCall, wire: Wire) -> Response:
    rollout = call.arrival.rollout
    await ctx.traffic.enter()
    ctx.recorder.in_flight(+1)
    ctx.recorder.timed("admission", call.arrival.received)
    streaming = False
    held: str | None = None
    sampling = merged(ctx.sampling, rollout.sampling if rollout is not None else None)
    call = replace(call, body=imposed(call.body, sampling))
    try:
        capture = capture_cls(new_record(ctx, capture_cls, call))
        upstream, asked = capture.inject(call.body, call.parsed)
        try:
            adapter = live_version(ctx.adapters, capture.record)
            if adapter is not None:  # held until the call ends: its version stays loaded meanwhile
                ctx.adapters.hold(adapter.name)
                held = adapter.name
                upstream["model"], asked = adapter.name, replace(asked, model=capture.record.model)
                call = replace(call, body=call.body | {"model": adapter.name})  # its renders and counts too
            response = await _turn(ctx, rollout, capture, call, upstream, asked, wire)
        except Refusal as refusal:
            await ctx.recorder.refused(capture, refusal.limit, refusal.message)
            raise
        except StoreUnavailable:
            raise
        except ApiError as exc:
            await ctx.recorder.failed(capture, exc.status_code, exc.message)
            raise
        streaming = isinstance(response, RelayResponse)  # in flight until its stream ends
        return response
    finally:
        if not streaming:
            _leave(ctx, held)


async def _turn(
    ctx: TurnContext,
    rollout: RolloutState | None,
    capture: TurnCapture,
    call: AgentCall,
    upstream: dict[str, Any],
    asked: Asked,
    wire: Wire,
) -> Response:
    limits = limits_of(ctx, rollout)
    check_turn_limit(capture, rollout, limits)
    mode = (rollout.mode if rollout is not None else None) or ctx.mode
    given = capture.sent_prompt  # the client's own prompt ids (`/chat/completions/tokens`)
    exact = (
        mode == Mode.EXACT
        and given is None
        and isinstance(capture, ChatCapture)
        and await _exact_capable(ctx, capture)
    )
    started = time.perf_counter()
    if exact:
        assert isinstance(capture, ChatCapture)
        prompt = await exact_prompt(ctx, capture, call.body)
        with_prompt(upstream, prompt)
        ctx.recorder.timed("render", started)
        if limits.max_context_tokens is not None:
            cap_reply(upstream, check_context_limit(len(prompt), limits.max_context_tokens))
    elif given is not None:
        with_prompt(upstream, given.tolist())
        if limits.max_context_tokens is not None:
            cap_reply(upstream, check_context_limit(len(given), limits.max_context_tokens))
    elif limits.max_context_tokens is not None:
        counted = await count_prompt(ctx, capture, call.body)
        ctx.recorder.timed("render", started)
        cap_reply(upstream, check_context_limit(counted, limits.max_context_tokens))
    leads = ctx.leader_first and rollout is not None and not rollout.calls and (rollout.group_size or 0) > 1
    ahead = ahead_of(capture, upstream) if leads else None
    sent = time.perf_counter()
    if call.stream:
        reply = await send(ctx.engine, capture, upstream, ahead=ahead)
        chunks = _chunks(ctx.recorder, capture, reply, asked, wire, sent)
        ended = partial(_leave, ctx, capture.record.adapter)
        return RelayResponse(relay(ctx.recorder, capture, reply, chunks, wire), ended)
    return await _whole(ctx, capture, upstream, asked, wire, sent, ahead)


async def _exact_capable(ctx: TurnContext, capture: ChatCapture) -> bool:
    """Whether the server the rollout is pinned to serves exact mode; the rollout is pinned first (its turn
    goes there next)."""
    record = capture.record
    server, _ = await ctx.engine.route(record.rollout_id, record.adapter or record.model)
    return await ctx.engine.exact_capable(server)


def _leave(ctx: TurnContext, adapter: str | None) -> None:
    ctx.traffic.leave()
    ctx.recorder.in_flight(-1)
    if adapter is not None:
        ctx.adapters.release(adapter)


async def _whole(
    ctx: TurnContext,
    capture: TurnCapture,
    upstream: dict[str, Any],
    asked: Asked,
    wire: Wire,
    sent: float,
    ahead: Ahead | None,
) -> Response:
    reply = await send(ctx.engine, capture, upstream, ahead=ahead)
    try:
        raw = await reply.body()
    except BackendStreamError as exc:
        raise ApiError(502, str(exc), "backend_error") from None
    ctx.recorder.timed("upstream", sent)
    payload = capture.feed_reply(raw, asked)
    records = capture.finish()
    for record in records:
        record.finished_at = record.first_token_at = time.time()
        record.http_status = 200
    capture.strip(payload, asked)
    await ctx.recorder.commit(records)
    return wire.reply(payload)


async def _chunks(
    recorder: Recorder, capture: TurnCapture, reply: BackendReply, asked: Asked, wire: Wire, sent: float
) -> AsyncIterator[bytes]:
    """vLLM's chunks as they arrive, captured, then stripped of what the gateway injected. The events one
    network read completes go to the agent in one write: under load several tokens of a stream arrive
    together, and each write costs the relay's whole path down to the socket."""
    record = capture.record
    first = 0.0
    sampled = 0
    try:
        async for batch in sse_batches(reply.read):
            if record.first_token_at is None:
                record.first_token_at = time.time()
                recorder.timed("upstream", sent)
                first = time.perf_counter()
            relayed: list[dict[str, Any]] = []
            try:
                for data in batch:
                    if data == b"[DONE]":
                        reply.ended()
                        recorder.timed("relay", first)
                        return
                    chunk = capture.read_chunk(data, asked)
                    if "error" in chunk and "choices" not in chunk:
                        message = backend_error_detail(data).get("message")
                        raise StreamFailure(str(message) if message is not None else "backend stream failed")
                    if capture.take(chunk, asked):
                        relayed.append(chunk)
            finally:
                now = capture.sampled()
                recorder.relayed(now - sampled)
                sampled = now
                if relayed:  # what came before the end or a failure reaches the agent first
                    yield wire.chunks(relayed)
    except BackendStreamError as exc:
        raise StreamFailure(str(exc)) from exc
    except orjson.JSONDecodeError as exc:
        raise StreamFailure(f"backend sent a chunk that is not JSON: {exc}") from exc
    raise StreamFailure("backend stream ended without [DONE]")
