"""HTTP routes of the agent API under `/rollouts/{rollout_id}/v1`: parse once, check, forward."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from gateway.errors import ApiError, validation_message
from gateway.ids import check_rollout_id
from gateway.openai.capture import ChatCapture, CompletionCapture
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai.proxy import forward
from gateway.state import GatewayState, get_state

router = APIRouter(prefix="/rollouts/{rollout_id}/v1")


async def read_json(request: Request, max_bytes: int, model: type[BaseModel]) -> dict[str, Any]:
    """The request body as a dict, parsed once; checked against `model` but forwarded as sent."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    try:
        model.model_validate(payload)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise ApiError(422, message, "invalid_request", param) from None
    return payload


@router.post("/chat/completions")
async def chat_completions(rollout_id: str, request: Request, state: GatewayState = Depends(get_state)) -> Response:
    check_rollout_id(rollout_id)
    body = await read_json(request, state.settings.max_body_bytes, ChatCompletionRequest)
    return await forward(state, rollout_id, ChatCapture, body)


@router.post("/completions")
async def completions(rollout_id: str, request: Request, state: GatewayState = Depends(get_state)) -> Response:
    check_rollout_id(rollout_id)
    body = await read_json(request, state.settings.max_body_bytes, CompletionRequest)
    return await forward(state, rollout_id, CompletionCapture, body)


@router.get("/models")
async def models(rollout_id: str, state: GatewayState = Depends(get_state)) -> Response:
    check_rollout_id(rollout_id)
    status, content = await state.backends.get("/v1/models")
    return Response(content, status_code=status, media_type="application/json")
