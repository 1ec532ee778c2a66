"""The one JSON encoding of every answer the gateway writes: replies, errors, store rows."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def dumps(value: Any) -> bytes:
    """orjson with the options store rows need: database drivers hand back `str` subclasses as keys
    (SQLAlchemy's `quoted_name`) and numpy scalars, which plain orjson refuses."""
    return orjson.dumps(value, option=_OPTIONS)


class JsonResponse(Response):
    """FastAPI's response class for the whole app, so that every route encodes through `dumps`."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
