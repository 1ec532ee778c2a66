"""HTTP routes of the OpenAI dialect under `/rollouts/{rollout_id}/v1`: each call, admitted by its route, is
parsed once, checked and forwarded."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from gateway.encoding import dumps
from gateway.errors import ApiError, backend_answer, backend_failure, error_responses
from gateway.fleet.replies import BackendFailure, BackendStreamError
from gateway.openai.protocol import (
    ChatCompletion,
    ChatCompletionTokensRequest,
    Completion,
    CompletionRequest,
    ModelList,
    TokenRouteRequest,
)
from gateway.openapi import raw_body
from gateway.turns.adapters import listed
from gateway.turns.capture import ChatCapture, CompletionCapture, TokensChatCapture
from gateway.turns.context import TurnContext, turn_context
from gateway.turns.forward import forward
from gateway.turns.intake import AgentRoute, Arrival, arrive, read_call
from gateway.turns.requests import ChatCompletionRequest
from gateway.turns.wire import OpenAIWire

router = APIRouter(
    prefix="/rollouts/{rollout_id}/v1",
    tags=["agent"],
    responses=error_responses(400, 401, 404, 409, 413, 422, 502, 503, 504),
    route_class=AgentRoute,
)
_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "description": "Each server-sent event as vLLM sends it: `data` holds a chunk as JSON, the "
            "last one [DONE] (OpenAPI 3.1 describes an event stream by its events)",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "required": ["data"],
        }
    }
}


@router.post(
    "/chat/completions",
    openapi_extra=raw_body(ChatCompletionRequest),
    response_model=ChatCompletion,
    responses={200: {"content": _STREAM}},
)
async def chat_completions(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """OpenAI chat completions, forwarded to the rollout's vLLM server and recorded as a turn."""
    call = await read_call(request, ctx, arrival, ChatCompletionRequest)
    return await forward(ctx, ChatCapture, call, OpenAIWire())


@router.post(
    "/chat/completions/tokens",
    openapi_extra=raw_body(ChatCompletionTokensRequest),
    response_model=ChatCompletion,
    responses={200: {"content": _STREAM}},
)
async def chat_completions_tokens(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """Chat completions from a prompt the client gives as ids (`tokens`, beside its messages), as token-aware
    RL clients call it: the engine generates from those ids, and the turn is recorded like any other."""
    call = await read_call(request, ctx, arrival, ChatCompletionTokensRequest)
    return await forward(ctx, TokensChatCapture, call, OpenAIWire())


@router.post(
    "/completions",
    openapi_extra=raw_body(CompletionRequest),
    response_model=Completion,
    responses={200: {"content": _STREAM}},
)
async def completions(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """OpenAI completions (a prompt as text or token ids), forwarded and recorded as a turn."""
    call = await read_call(request, ctx, arrival, CompletionRequest)
    return await forward(ctx, CompletionCapture, call, OpenAIWire())


tokens_router = APIRouter(
    prefix="/rollouts/{rollout_id}",
    tags=["agent"],
    responses=error_responses(400, 401, 404, 409, 413, 422, 502, 503, 504),
    route_class=AgentRoute,
)
"""vLLM's token routes, at the root of a rollout's base URL as vLLM serves them at its own root (token-aware
clients strip `/v1` to reach them). They record nothing: they generate nothing."""


async def _token_route(request: Request, ctx: TurnContext, arrival: Arrival, path: str) -> Response:
    call = await read_call(request, ctx, arrival, TokenRouteRequest)
    try:
        routed = await ctx.engine.send(arrival.rollout_id, path, dumps(call.body), call.body.get("model"))
    except BackendFailure as exc:
        raise backend_failure(exc) from None
    try:
        content = await routed.reply.body()
    except BackendStreamError as exc:
        raise ApiError(502, str(exc), "backend_error") from None
    if routed.reply.status != 200:
        raise backend_answer(routed.reply.status, content)
    return Response(content, media_type="application/json")


@tokens_router.post("/tokenize", openapi_extra=raw_body(TokenRouteRequest))
async def tokenize(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """vLLM's /tokenize on the rollout's server: a prompt or chat messages (with tools) to the ids the
    engine would see."""
    return await _token_route(request, ctx, arrival, "/tokenize")


@tokens_router.post("/detokenize", openapi_extra=raw_body(TokenRouteRequest))
async def detokenize(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """vLLM's /detokenize on the rollout's server: ids to text."""
    return await _token_route(request, ctx, arrival, "/detokenize")


@router.get("/models", response_model=ModelList)
async def models(
    request: Request, ctx: TurnContext = Depends(turn_context), arrival: Arrival = Depends(arrive)
) -> Response:
    """The backends' models (as vLLM lists them)."""
    status, content = await ctx.engine.get("/v1/models")
    if status != 200:
        raise ApiError(502, f"backend answered HTTP {status} to GET /v1/models", "backend_error")
    if ctx.adapters.bases:  # LoRA policies are listed by their names, not their versions'
        content = dumps(listed(content, ctx.adapters))
    return Response(content, media_type="application/json")
