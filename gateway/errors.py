"""Errors in the OpenAI format (`{"error": {"message", "type", "param", "code"}}`) for every failure path, and
the one place where failures of the store and of the backends become HTTP statuses."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.encoding import dumps
from gateway.fleet.replies import BackendFailure
from gateway.store.records import StoreError

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None
    """The gateway's own codes are strings; a backend's error is passed on as it sent it."""


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error statuses a route can answer."""
    return {status: {"model": ErrorResponse, "description": "OpenAI-format error"} for status in statuses}


class ApiError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        code: str | int | None,
        param: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind


_STORE_STATUS = {
    "rollout_not_found": 404,
    "turn_not_found": 404,
    "rollout_conflict": 409,
    "group_size_conflict": 409,
    "group_full": 409,
    "group_claimed": 409,
    "rollout_finished": 409,
    "rollout_expired": 409,
}
_BACKEND_STATUS = {
    "timeout": (504, "backend_timeout"),
    "unreachable": (503, "backend_unavailable"),
    "busy": (503, "backend_busy"),
    "queue_full": (503, "queue_full"),
    "failed": (502, "backend_error"),
}
_CONTEXT_TOO_LONG = ("maximum context length", "longer than the maximum model length")
"""How vLLM words a prompt that does not fit the model's context."""


class StoreUnavailable(ApiError):
    """A turn the engine answered could not be stored (the database failed, not the request)."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(503, f"the turn could not be stored: {type(exc).__name__}", "store_unavailable")


def store_failure(exc: StoreError) -> ApiError:
    return ApiError(_STORE_STATUS.get(exc.code, 409), exc.message, exc.code)


def backend_failure(exc: BackendFailure) -> ApiError:
    status, code = _BACKEND_STATUS[exc.kind]
    return ApiError(status, exc.message, code)


def backend_answer(status: int, content: bytes) -> ApiError:
    """The agent-facing error for a backend's non-200 answer: its own 4xx as vLLM wrote it (message, type,
    param), a prompt too long for the model as `context_length_exceeded`, anything else a 502."""
    if status in (401, 403):
        return ApiError(
            502,
            f"backend refused the gateway's credentials (HTTP {status}): check --backend-api-key",
            "backend_error",
        )
    detail = backend_error_detail(content)
    message = str(detail.get("message") or f"backend answered HTTP {status}")
    if status >= 500:
        return ApiError(502, message, "backend_error")
    if any(phrase in message for phrase in _CONTEXT_TOO_LONG):
        return ApiError(400, message, "context_length_exceeded", detail.get("param"), detail.get("type"))
    code = detail.get("code")
    return ApiError(
        status,
        message,
        code if isinstance(code, str | int) else "invalid_request",
        detail.get("param") if isinstance(detail.get("param"), str) else None,
        detail.get("type") if isinstance(detail.get("type"), str) else None,
    )


def backend_error_detail(content: bytes) -> dict[str, Any]:
    """vLLM's `{"error": {...}}` (or an older flat `{"message", ...}`); text otherwise."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {"message": content[:500].decode("utf-8", "replace") or None}
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return error
        if "message" in payload:
            return payload
    return {}


def error_body(
    status_code: int, message: str, code: str | int | None, param: str | None = None, kind: str | None = None
) -> bytes:
    kind = kind or ("invalid_request_error" if status_code < 500 else "server_error")
    return dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def retry_headers(status_code: int) -> dict[str, str] | None:
    """Tell the OpenAI and Anthropic SDKs not to retry an answer a retry cannot change (they retry 409 and
    every 5xx by default, and honour `x-should-retry`), and to retry a 503 after a second: the gateway is
    briefly unable to serve (no backend, a busy one, no store) and will be again."""
    if 400 <= status_code < 500 and status_code not in (408, 429):
        return {"x-should-retry": "false"}
    if status_code == 503:
        return {"x-should-retry": "true", "retry-after": "1"}
    return None


def error_response(
    status_code: int, message: str, code: str | int | None, param: str | None = None, kind: str | None = None
) -> Response:
    return Response(
        error_body(status_code, message, code, param, kind),
        status_code,
        headers=retry_headers(status_code),
        media_type="application/json",
    )


def string_field(item: dict[str, Any], key: str, where: str) -> str:
    """A string field of an object inside an agent's request (a content block, an input item), or a 400
    naming it (`where` is the object's place in the request)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key}: expected a string", "invalid_request", f"{where}.{key}")
    return value


def joined_text(value: Any, where: str, parts: str, part_text: Callable[[Any, str], str]) -> str:
    """A string, or a list of parts joined, or a 400 naming the field: what message contents, system prompts
    and tool results hold in the agents' dialects. Each dialect says which parts it takes: `part_text` gives
    a part's text (from the part and its place) or raises, and `parts` is what the dialect calls them."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(400, f"{where}: expected text or a list of text {parts}", "invalid_request", where)
    return "".join(part_text(part, f"{where}.{index}") for index, part in enumerate(value))


def validation_message(errors: list) -> tuple[str, str | None]:  # type: ignore[type-arg]
    """A one-line summary of pydantic errors, and the first offending parameter."""
    parts = []
    for error in errors[:5]:
        parts.append(f"{_location(error.get('loc', ())) or 'body'}: {error.get('msg')}")
    return "; ".join(parts), (_location(errors[0].get("loc", ())) if errors else None) or None


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")
"""What pydantic puts in an error's location to say which member of a union it tried (`str`, `list[...]`):
not a parameter name."""


def _location(loc: Iterable[Any]) -> str:
    return ".".join(
        str(p) for p in loc if p not in ("body", "query", "path") and not _UNION_MEMBER.match(str(p))
    )


_ROUTES_HELP = (
    "agent API under /rollouts/{rollout_id}/v1: POST chat/completions, POST chat/completions/tokens, POST "
    "completions, POST messages, POST messages/count_tokens, POST responses, GET responses/{id}, GET models; "
    "token routes: POST /rollouts/{rollout_id}/tokenize, /rollouts/{rollout_id}/detokenize; "
    "control API: POST /rollouts, POST /rollouts/{id}/reward, POST /rollouts/{id}/finish, "
    "GET /rollouts/{id}; "
    "admin API: /admin/pause, /admin/resume, /admin/policy_version, /admin/reload_weights, /admin/backends, "
    "/admin/backends/drain, GET /admin/state; "
    "GET /healthz, /readyz, /metrics, /openapi.json, /docs"
)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status_code, exc.message, exc.code, exc.param, exc.kind)

    @app.exception_handler(StoreError)
    async def _store_error(_: Request, exc: StoreError) -> Response:
        error = store_failure(exc)
        return error_response(error.status_code, error.message, error.code)

    @app.exception_handler(BackendFailure)
    async def _backend_failure(_: Request, exc: BackendFailure) -> Response:
        error = backend_failure(exc)
        return error_response(error.status_code, error.message, error.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "request body is not valid JSON", "invalid_json")
        message, param = validation_message(errors)
        return error_response(422, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; the gateway serves: {_ROUTES_HELP}"
            return error_response(404, message, "unknown_route")
        if exc.status_code == 405:
            return error_response(
                405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
            )
        return error_response(exc.status_code, str(exc.detail), "http_error")

    @app.exception_handler(OperationalError)
    async def _store_unreachable(_: Request, exc: OperationalError) -> Response:
        log.warning("the store could not be reached: %s", exc.orig)
        return error_response(503, "the gateway cannot reach its store; retry shortly", "store_unavailable")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
