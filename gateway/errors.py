"""Errors in the OpenAI format (`{"error": {"message", "type", "param", "code"}}`) for every failure path."""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.store.records import StoreError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status_code: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


def error_body(status_code: int, message: str, code: str | None, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def error_response(status_code: int, message: str, code: str | None, param: str | None = None) -> Response:
    return Response(error_body(status_code, message, code, param), status_code, media_type="application/json")


def validation_message(errors: list) -> tuple[str, str | None]:  # type: ignore[type-arg]
    """A one-line summary of pydantic errors, and the first offending parameter."""
    parts = []
    for error in errors[:5]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg')}")
    first = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(p) for p in first if p != "body") or None
    return "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status_code, exc.message, exc.code, exc.param)

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
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), "http_error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
