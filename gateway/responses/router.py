"""HTTP routes of the Responses dialect under `/rollouts/{rollout_id}/v1` (the OpenAI SDK's base URL, as for
chat): each call, admitted by its route, is parsed once, a previous response's conversation put first,
translated to chat and forwarded. A rollout's responses are its turns: `GET responses/{id}` reads one back
from the store."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from gateway.auth import check_agent_key
from gateway.encoding import JsonResponse
from gateway.errors import ApiError, error_responses
from gateway.ids import new_id
from gateway.openapi import event_stream, raw_body
from gateway.responses.items import ResponseShape, stored_response
from gateway.responses.protocol import ResponseObject, ResponsesRequest
from gateway.responses.translate import chat_tools, previous_conversation, to_chat
from gateway.responses.wire import ResponsesWire
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
    "Responses events: response.created, response.in_progress, output item and content part events with "
    "their deltas, response.completed (or response.incomplete)"
)


@router.post(
    "/responses",
    openapi_extra=raw_body(ResponsesRequest),
    response_model=ResponseObject,
    responses={200: {"content": _STREAM}},
)
async def create_response(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """OpenAI Responses, translated to a chat call on the rollout's vLLM server and recorded as a turn."""
    call = await read_call(request, ctx, arrival, ResponsesRequest)
    body = call.body
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        turn = await _stored(ctx, arrival.rollout_id, previous, "previous_response_id")
        if turn["status"] != "ok":
            message = f"response {previous!r} failed ({turn['error']}): there is no reply to continue from"
            raise ApiError(400, message, "previous_response_failed", "previous_response_id")
        history = previous_conversation(turn)
    chat, names = to_chat(body, history)
    response_id = "resp_" + new_id()
    original = {key: value for key, value in body.items() if key != "input"}
    call = replace(
        call,
        body=chat,
        parsed=validated(ChatCompletionRequest, chat),
        dialect="responses",
        original=original,
        response_id=response_id if body.get("store", True) is not False else None,
    )
    wire = ResponsesWire(ResponseShape(response_id, original, names, time.time()), body.get("model"))
    return await forward(ctx, ChatCapture, call, wire)


@router.get("/responses/{response_id}", response_model=ResponseObject)
async def get_response(
    rollout_id: str, response_id: str, request: Request, ctx: TurnContext = Depends(turn_context)
) -> Response:
    """A response of this rollout as it was created (`store: false` responses are not kept): a read, allowed
    on a finished rollout, so not admitted; its key is checked all the same."""
    if ctx.rollout_keys:
        check_agent_key(request, rollout_id, await ctx.recorder.rollout_state(rollout_id))
    turn = await _stored(ctx, rollout_id, response_id, None)
    request_fields = turn["request"] or {}
    _, names = chat_tools(request_fields.get("tools"))
    shape = ResponseShape(response_id, request_fields, names, turn["started_at"])
    return JsonResponse(stored_response(shape, turn))


async def _stored(ctx: TurnContext, rollout_id: str, response_id: str, param: str | None) -> dict[str, Any]:
    turn = await ctx.recorder.response_turn(rollout_id, response_id)
    if turn is None:
        status = 400 if param is not None else 404
        message = f"response {response_id!r} not found in rollout {rollout_id!r}"
        raise ApiError(
            status, message, "previous_response_not_found" if param else "response_not_found", param
        )
    return turn
