"""HTTP routes of the Messages dialect under `/rollouts/{rollout_id}/v1` (an Anthropic SDK's base URL is
`/rollouts/{rollout_id}`: it appends `/v1/messages`): each call, admitted by its route, is parsed once,
translated to chat and forwarded."""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from gateway.anthropic.protocol import CountTokensRequest, MessageReply, MessagesRequest, TokenCount
from gateway.anthropic.translate import to_chat
from gateway.anthropic.wire import AnthropicWire
from gateway.encoding import JsonResponse
from gateway.errors import error_responses
from gateway.openapi import event_stream, raw_body
from gateway.store.records import TurnRecord
from gateway.turns.admission import prompt_tokens
from gateway.turns.capture import ChatCapture
from gateway.turns.context import TurnContext, turn_context
from gateway.turns.forward import forward
from gateway.turns.intake import AgentRoute, Arrival, arrive, read_call, validated
from gateway.turns.requests import ChatCompletionRequest

router = APIRouter(
    prefix="/rollouts/{rollout_id}/v1",
    tags=["agent"],
    responses=error_responses(400, 401, 404, 409, 413, 422, 502, 503, 504),
    route_class=AgentRoute,
)
_STREAM = event_stream(
    "Anthropic's Messages events: message_start, content_block_start/delta/stop per block, message_delta, "
    "message_stop"
)


@router.post(
    "/messages",
    openapi_extra=raw_body(MessagesRequest),
    response_model=MessageReply,
    responses={200: {"content": _STREAM}},
)
async def messages(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """Anthropic Messages, translated to a chat call on the rollout's vLLM server and recorded as a turn."""
    call = await read_call(request, ctx, arrival, MessagesRequest)
    chat = to_chat(call.body)
    call = replace(call, body=chat, parsed=validated(ChatCompletionRequest, chat), dialect="messages")
    return await forward(ctx, ChatCapture, call, AnthropicWire())


@router.post("/messages/count_tokens", openapi_extra=raw_body(CountTokensRequest), response_model=TokenCount)
async def count_tokens(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """The prompt's tokens as the served model's own template and tokenizer count them (vLLM's /tokenize)."""
    call = await read_call(request, ctx, arrival, CountTokensRequest)
    chat = to_chat({**call.body, "max_tokens": 1})
    version = ctx.recorder.policy_version
    record = TurnRecord(
        arrival.rollout_id, "messages/count_tokens", chat["model"], False, version, time.time()
    )
    capture = ChatCapture(record)
    return JsonResponse(TokenCount(input_tokens=await prompt_tokens(ctx, capture, chat)).model_dump())
