"""The OpenAPI document: FastAPI's, plus the request bodies of the routes that read their body raw.

The agent API parses each body once with orjson and forwards it as sent, so FastAPI does not see its models;
they are published here so that generated clients and schema-driven fuzzers know every field.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def raw_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route that reads its JSON body itself, validated against `model`."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def event_stream(description: str) -> dict[str, Any]:
    """The `content` of a 200 answered as server-sent events named by `event` (Messages, Responses)."""
    schema = {
        "type": "object",
        "description": description + " (`event` names the event, `data` holds it as JSON)",
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        "required": ["data"],
    }
    return {"text/event-stream": {"schema": schema}}


def install_openapi(app: FastAPI, raw_models: list[type[BaseModel]]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            _, defs = models_json_schema([(model, "validation") for model in raw_models], ref_template=_REF)
            document.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
