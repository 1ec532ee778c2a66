"""The one JSON encoding of every answer the gateway writes: replies, errors, store rows."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.responses import JSONResponse

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def dumps(value: Any) -> bytes:
    """orjson with the options store rows need: database drivers hand back `str` subclasses as keys
    (SQLAlchemy's `quoted_name`) and numpy scalars, which plain orjson refuses."""
    return orjson.dumps(value, option=_OPTIONS)


class JsonResponse(JSONResponse):
    """FastAPI's response class for the whole app, so that every route encodes through `dumps` (a
    JSONResponse, so that FastAPI documents each route's response model)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


def _storable(value: Any) -> Any:
    """Refuse what the store cannot write, though the standard library's JSON parser lets it through: text
    with no UTF-8 form (lone surrogates, which `\\ud800` escapes spell) and integers beyond 64 bits."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        raise ValueError("integers must fit in 64 bits")
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (a lone surrogate escape is not)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key)
            _storable(item)
    elif isinstance(value, list):
        for item in value:
            _storable(item)
    return value


class RequestModel(BaseModel):
    """A control or admin request body: no unknown fields, and only text the store can hold."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _only_storable_text(cls, data: Any) -> Any:
        return _storable(data)
