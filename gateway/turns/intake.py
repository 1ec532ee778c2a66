"""How an agent call comes in, whatever its dialect: its route called directly (`AgentRoute`), its body read
once with a size cap, parsed and checked (`read_call`), and the client's retry count read with it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from gateway.errors import ApiError, validation_message
from gateway.turns.context import TurnContext
from gateway.turns.forward import AgentCall

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
    """`body` read as `model`; a 422 naming the offending field otherwise. The integers `model` declares are
    put back into `body` as read (`5.0` and `"5"` as 5), so that every later step (a trainer's cap, a context
    limit, the stored params) and the engine see the agent's number as an int."""
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise ApiError(422, message, "invalid_request", param) from None
    for name in model.model_fields.keys() & body.keys():
        value = getattr(parsed, name)
        if type(value) is not int or type(body[name]) is int:
            continue
        if isinstance(body[name], bool):  # read as 1 or 0 by pydantic, never what the agent meant
            raise ApiError(
                422, f"{name}: Input should be a valid integer, not a boolean", "invalid_request", name
            )
        body[name] = value
    return parsed


def _attempt(request: Request) -> int:
    """The client's retry count: the OpenAI and Anthropic SDKs send it with every retry. Anything but a
    small decimal number (the store keeps it in 32 bits) counts as a first attempt."""
    value = request.headers.get("x-stainless-retry-count", "0")
    return int(value) if value.isascii() and value.isdigit() and len(value) <= _RETRY_DIGITS else 0


_RETRY_DIGITS = 9
