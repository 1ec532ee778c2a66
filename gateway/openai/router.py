"""HTTP routes of the agent API under `/rollouts/{rollout_id}/v1`: admit, parse once, check, forward."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from gateway.encoding import dumps
from gateway.errors import ApiError, backend_answer, backend_failure, error_responses, validation_message
from gateway.fleet.replies import BackendFailure, BackendStreamError
from gateway.ids import check_rollout_id
from gateway.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    ChatCompletionTokensRequest,
    Completion,
    CompletionRequest,
    ModelList,
    TokenRouteRequest,
)
from gateway.openapi import raw_body
from gateway.turns.admission import admit
from gateway.turns.capture import ChatCapture, CompletionCapture, TokensChatCapture, TurnCapture
from gateway.turns.context import TurnContext, turn_context
from gateway.turns.forward import AgentCall, forward
from gateway.turns.wire import OpenAIWire

ModelT = TypeVar("ModelT", bound=BaseModel)


class AgentRoute(APIRoute):
    """A route of the agent path: documented by FastAPI like any other, but called directly, without FastAPI's
    per-request dependency solving and endpoint wrapping (about 8% of the event loop's time per call in the
    profile of `bench/overhead_profile.py`).

    Its endpoint takes only the path's parameters (strings), the request and the agent path's `TurnContext`
    (declared `ctx: TurnContext = Depends(turn_context)` for the documentation), and answers a `Response`.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            ctx: TurnContext = request.app.state.turns
            response: Response = await endpoint(**request.path_params, request=request, ctx=ctx)
            return response

        return handle


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


async def read_call(request: Request, max_bytes: int, received: float, model: type[BaseModel]) -> AgentCall:
    """The request body parsed once, checked against `model` (forwarded as sent, not as parsed); `received`
    is when the route began (`time.perf_counter`)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    parsed = validated(model, body)
    request_hash = hashlib.blake2b(raw, digest_size=16).hexdigest()
    return AgentCall(body, parsed, request_hash, _attempt(request), received)


def validated(model: type[ModelT], body: dict[str, Any]) -> ModelT:
    """`body` read as `model`; a 422 naming the offending field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise ApiError(422, message, "invalid_request", param) from None


def _attempt(request: Request) -> int:
    """The client's retry count: the OpenAI and Anthropic SDKs send it with every retry. Anything but a
    small decimal number (the store keeps it in 32 bits) counts as a first attempt."""
    value = request.headers.get("x-stainless-retry-count", "0")
    return int(value) if value.isascii() and value.isdigit() and len(value) <= _RETRY_DIGITS else 0


_RETRY_DIGITS = 9


async def _agent_call(
    rollout_id: str, request: Request, ctx: TurnContext, model: type[BaseModel], capture: type[TurnCapture]
) -> Response:
    received = time.perf_counter()
    check_rollout_id(rollout_id)
    rollout = await admit(ctx, request, rollout_id)
    call = await read_call(request, ctx.max_body_bytes, received, model)
    return await forward(ctx, rollout_id, rollout, capture, call, OpenAIWire())


@router.post(
    "/chat/completions",
    openapi_extra=raw_body(ChatCompletionRequest),
    response_model=ChatCompletion,
    responses={200: {"content": _STREAM}},
)
async def chat_completions(
    rollout_id: str, request: Request, ctx: TurnContext = Depends(turn_context)
) -> Response:
    """OpenAI chat completions, forwarded to the rollout's vLLM server and recorded as a turn."""
    return await _agent_call(rollout_id, request, ctx, ChatCompletionRequest, ChatCapture)


@router.post(
    "/chat/completions/tokens",
    openapi_extra=raw_body(ChatCompletionTokensRequest),
    response_model=ChatCompletion,
    responses={200: {"content": _STREAM}},
)
async def chat_completions_tokens(
    rollout_id: str, request: Request, ctx: TurnContext = Depends(turn_context)
) -> Response:
    """Chat completions from a prompt the client gives as ids (`tokens`, beside its messages), as token-aware
    RL clients call it: the engine generates from those ids, and the turn is recorded like any other."""
    return await _agent_call(rollout_id, request, ctx, ChatCompletionTokensRequest, TokensChatCapture)


@router.post(
    "/completions",
    openapi_extra=raw_body(CompletionRequest),
    response_model=Completion,
    responses={200: {"content": _STREAM}},
)
async def completions(
    rollout_id: str, request: Request, ctx: TurnContext = Depends(turn_context)
) -> Response:
    """OpenAI completions (a prompt as text or token ids), forwarded and recorded as a turn."""
    return await _agent_call(rollout_id, request, ctx, CompletionRequest, CompletionCapture)


tokens_router = APIRouter(
    prefix="/rollouts/{rollout_id}",
    tags=["agent"],
    responses=error_responses(400, 401, 404, 409, 413, 422, 502, 503, 504),
    route_class=AgentRoute,
)
"""vLLM's token routes, at the root of a rollout's base URL as vLLM serves them at its own root (token-aware
clients strip `/v1` to reach them). They record nothing: they generate nothing."""


async def _token_route(rollout_id: str, request: Request, ctx: TurnContext, path: str) -> Response:
    check_rollout_id(rollout_id)
    await admit(ctx, request, rollout_id)
    call = await read_call(request, ctx.max_body_bytes, time.perf_counter(), TokenRouteRequest)
    try:
        routed = await ctx.backends.send(rollout_id, path, dumps(call.body), call.body.get("model"))
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
async def tokenize(rollout_id: str, request: Request, ctx: TurnContext = Depends(turn_context)) -> Response:
    """vLLM's /tokenize on the rollout's server: a prompt or chat messages (with tools) to the ids the
    engine would see."""
    return await _token_route(rollout_id, request, ctx, "/tokenize")


@tokens_router.post("/detokenize", openapi_extra=raw_body(TokenRouteRequest))
async def detokenize(rollout_id: str, request: Request, ctx: TurnContext = Depends(turn_context)) -> Response:
    """vLLM's /detokenize on the rollout's server: ids to text."""
    return await _token_route(rollout_id, request, ctx, "/detokenize")


@router.get("/models", response_model=ModelList)
async def models(rollout_id: str, request: Request, ctx: TurnContext = Depends(turn_context)) -> Response:
    """The backends' models (as vLLM lists them)."""
    check_rollout_id(rollout_id)
    await admit(ctx, request, rollout_id)
    status, content = await ctx.backends.get("/v1/models")
    if status != 200:
        raise ApiError(502, f"backend answered HTTP {status} to GET /v1/models", "backend_error")
    return Response(content, media_type="application/json")
