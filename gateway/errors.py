"""Errors in the OpenAI format (`{"error": {"message", "type", "param", "code"}}`) for every failure path."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.encoding import dumps
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


def error_body(
    status_code: int, message: str, code: str | int | None, param: str | None = None, kind: str | None = None
) -> bytes:
    kind = kind or ("invalid_request_error" if status_code < 500 else "server_error")
    return dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def retry_headers(status_code: int) -> dict[str, str] | None:
    """Tell the OpenAI and Anthropic SDKs not to retry an answer a retry cannot change (they retry 409 and
    every 5xx by default, and honour `x-should-retry`)."""
    if 400 <= status_code < 500 and status_code not in (408, 429):
        return {"x-should-retry": "false"}
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


def validation_message(errors: list) -> tuple[str, str | None]:  # type: ignore[type-arg]
    """A one-line summary of pydantic errors, and the first offending parameter."""
    parts = []
    for error in errors[:5]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "query", "path"))
        parts.append(f"{location or 'body'}: {error.get('msg')}")
    first = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(p) for p in first if p not in ("body", "query", "path")) or None
    return "; ".join(parts), param


_ROUTES_HELP = (
    "agent API under /rollouts/{rollout_id}/v1: POST chat/completions, POST completions, GET models; "
    "control API: POST /rollouts, POST /rollouts/{id}/reward, POST /rollouts/{id}/finish, GET /rollouts/{id}; "
    "admin API: /admin/pause, /admin/resume, /admin/policy_version, /admin/reload_weights, GET /admin/state; "
    "GET /healthz, /metrics, /openapi.json, /docs"
)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status_code, exc.message, exc.code, exc.param, exc.kind)

    @app.exception_handler(StoreError)
    async def _store_error(_: Request, exc: StoreError) -> Response:
        return error_response(exc.status_code, exc.message, exc.code)

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

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
