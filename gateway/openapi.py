"""The OpenAPI document: FastAPI's, plus the request bodies of the routes that read their body raw; and its
pages, `/docs` and `/redoc`, with every asset served by the gateway.

The agent API parses each body once with orjson and forwards it as sent, so FastAPI does not see its models;
they are published here so that generated clients and schema-driven fuzzers know every field.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

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


DOCS_ASSETS = "/docs/assets"


def install_docs(app: FastAPI) -> None:
    """`/docs` (Swagger UI) and `/redoc`, their scripts and styles served from here: FastAPI's defaults load
    them from a CDN, and render blank on a cluster without internet. The assets are those the
    `fastapi-offline` package ships."""
    assets = str(resources.files("fastapi_offline") / "static")
    app.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")

    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
        )

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + "/openapi.json",
            title=f"{app.title} API",
            redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )

    app.add_api_route("/docs", swagger, include_in_schema=False)
    app.add_api_route("/redoc", redoc, include_in_schema=False)
