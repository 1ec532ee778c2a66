"""How an agent call comes in, whatever its dialect: its route called directly and opened there (`AgentRoute`:
the rollout id checked, the call admitted), its body read once with a size cap, parsed and checked
(`read_call`), and the client's retry count read with it."""

from __future__ import annotations

import hashlib
import inspect
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import Depends, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from gateway.errors import ApiError, validation_message
from gateway.ids import check_rollout_id
from gateway.store.records import RolloutState
from gateway.turns.admission import admit
from gateway.turns.context import TurnContext, turn_context

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class Arrival:
    """An agent call let in: its rollout, as `admit` read it, and when its route began (`time.perf_counter`):
    the admission stage ends when the call leaves."""

    rollout_id: str
    rollout: RolloutState | None
    received: float


async def arrive(rollout_id: str, request: Request, ctx: TurnContext = Depends(turn_context)) -> Arrival:
    """The opening of a call that reaches the engine: a bad rollout id is refused before anything is read."""
    received = time.perf_counter()
    check_rollout_id(rollout_id)
    return Arrival(rollout_id, await admit(ctx, request, rollout_id), received)


@dataclass(frozen=True)
class AgentCall:
    """An agent's request: the body as sent, its validated reading, and what identifies a client's retry."""

    body: dict[str, Any]
    parsed: BaseModel
    request_hash: str
    attempt: int
    arrival: Arrival
    dialect: str | None = None
    """The wire format the agent spoke when it is not the engine's own (`messages`, `responses`): the turn's
    endpoint."""
    original: dict[str, Any] | None = None
    """The dialect's own request, minus the conversation `body` holds as chat messages; stored with the
    turn."""
    response_id: str | None = None
    """Responses: the id the reply carries and the turn is found by."""

    @property
    def stream(self) -> bool:
        return bool(getattr(self.parsed, "stream", False))

    @property
    def choices(self) -> int:
        return getattr(self.parsed, "n", None) or 1


class AgentRoute(APIRoute):
    """A route of the agent path: documented by FastAPI like any other, but called directly, without FastAPI's
    per-request dependency solving and endpoint wrapping (about 8% of the event loop's time per call in the
    profile of `bench/overhead_profile.py`).

    Its endpoint takes the path's parameters (strings), the request and the agent path's `TurnContext`
    (declared `ctx: TurnContext = Depends(turn_context)` for the documentation), and answers a `Response`.
    The route opens every call itself, once: an endpoint that declares `arrival: Arrival = Depends(arrive)`
    reaches the engine, and is handed the call admitted in place of its rollout id; any other (a read of what
    is stored, allowed on a finished rollout) is handed the rollout id checked, and checks the rest itself.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint
        admits = "arrival" in inspect.signature(endpoint).parameters

        async def handle(request: Request) -> Response:
            ctx: TurnContext = request.app.state.turns
            given = dict(request.path_params)
            rollout_id = given.pop("rollout_id")
            if admits:
                given["arrival"] = await arrive(rollout_id, request, ctx)
            else:
                given["rollout_id"] = check_rollout_id(rollout_id)
            response: Response = await endpoint(**given, request=request, ctx=ctx)
            return response

        return handle


async def read_call(
    request: Request, ctx: TurnContext, arrival: Arrival, model: type[BaseModel]
) -> AgentCall:
    """The request body parsed once, checked against `model` (forwarded as sent, not as parsed)."""
    max_bytes = ctx.max_body_bytes
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
    return AgentCall(body, parsed, request_hash, _attempt(request), arrival)


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
