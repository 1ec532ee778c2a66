"""Exact mode, streamed: each generate event is derendered into the agent's chat chunk as it arrives."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from gateway.backend import BackendReply, BackendStreamError
from gateway.errors import ApiError
from gateway.store.records import Limits
from gateway.turns.capture import Asked, ChatCapture
from gateway.turns.context import TurnContext
from gateway.turns.exact import DERENDER, GENERATE, feed_reply, generate_body, prompt_for, without_end_token
from gateway.turns.relay import StreamFailure, relay
from gateway.turns.sse import sse_data
from gateway.turns.upstream import post_json, send
from gateway.turns.wire import Wire


async def forward_exact_stream(
    ctx: TurnContext, capture: ChatCapture, body: dict[str, Any], asked: Asked, limits: Limits, wire: Wire
) -> Response:
    request = await prompt_for(ctx, capture, body)
    generate = generate_body(capture, request, body, True, limits)
    reply = await send(ctx.backends, capture, generate, GENERATE)
    chunks = _chunks(ctx, capture, reply, body, request["token_ids"], asked, wire)
    return StreamingResponse(
        relay(ctx.recorder, capture, reply, chunks, wire), media_type="text/event-stream"
    )


async def _chunks(
    ctx: TurnContext,
    capture: ChatCapture,
    reply: BackendReply,
    body: dict[str, Any],
    prompt: list[int],
    asked: Asked,
    wire: Wire,
) -> AsyncIterator[bytes]:
    """The agent's chat chunks, one derender call per generate event.

    vLLM's tool and reasoning parsers are built to see a reply one engine step at a time, and the end of a
    reply as a call of its own with the finish flag (the final flush of a buffered tool call): merging events,
    or leaving out the last one once its end token is trimmed, loses or delays tool calls. vLLM's streaming
    derender replays the output before each call, so a reply of n tokens costs about n²/2 parser steps.
    """
    record = capture.record
    capture.prompt_ids = prompt
    stream_state: Any = None
    first = True
    last: dict[str, Any] = {}
    try:
        async for data in sse_data(reply.chunks()):
            if data == b"[DONE]":
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield wire.chunk(_usage_chunk(last, len(prompt), len(capture.choice(0).completion_ids)))
                return
            event = orjson.loads(data)
            if "error" in event and "choices" not in event:
                raise StreamFailure(str(event["error"]))
            if record.first_token_at is None:
                record.first_token_at = time.time()
            first_choice = capture.choice(0)
            for choice in event.get("choices") or ():
                first_choice.completion_ids.extend(choice.get("token_ids") or ())
                record.weight_versions = choice.get("weight_versions") or record.weight_versions
                first_choice.logprobs.extend(
                    e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or ()
                )
            chunk, stream_state = await _derender(
                ctx, capture, body, prompt, without_end_token(event), stream_state
            )
            if chunk is None:
                continue
            feed_reply(capture, chunk)
            if asked.token_ids:
                if first:
                    chunk["prompt_token_ids"] = prompt
                for out, choice in zip(chunk.get("choices") or (), event.get("choices") or (), strict=False):
                    out["token_ids"] = choice.get("token_ids")
            capture.strip(chunk, asked)
            first, last = False, chunk
            yield wire.chunk(chunk)
    except ApiError as exc:
        raise StreamFailure(exc.message) from exc
    except BackendStreamError as exc:
        raise StreamFailure(str(exc)) from exc
    except orjson.JSONDecodeError as exc:
        raise StreamFailure(f"backend sent an event that is not JSON: {exc}") from exc
    raise StreamFailure("backend stream ended without [DONE]")


async def _derender(
    ctx: TurnContext,
    capture: ChatCapture,
    body: dict[str, Any],
    prompt: list[int],
    event: dict[str, Any],
    stream_state: Any,
) -> tuple[dict[str, Any] | None, Any]:
    """One derender call; None for an event with neither tokens nor a finish (nothing to say)."""
    choices = event.get("choices") or []
    if choices and not choices[0].get("token_ids") and choices[0].get("finish_reason") is None:
        return None, stream_state
    request = {
        "stream": True,
        "generate_chunk": event,
        "stream_state": stream_state,
        "chat_request": body,
        "prompt_token_ids": prompt,
        "prompt_tokens": len(prompt),
    }
    answer = await post_json(ctx.backends, capture, request, DERENDER)
    return answer["chunk"], answer["stream_state"]


def _usage_chunk(last: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The final chunk vLLM's chat endpoint sends when the agent asks for usage (`stream_options`)."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    fields: dict[str, Any] = {k: last[k] for k in ("id", "object", "created", "model") if k in last}
    return {**fields, "choices": [], "usage": usage}
