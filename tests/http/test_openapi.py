"""The API docs pages (`/docs`, `/redoc`) load nothing from outside the gateway: a cluster without internet
renders them whole."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = pytest.mark.anyio


async def assert_served_here(gw: Any, path: str, assets: list[str]) -> None:
    html = (await gw.client.get(path)).text
    assert re.findall(r"https?://", html) == []
    for asset in assets:
        assert f'"{asset}"' in html
        served = await gw.client.get(asset)
        assert served.status_code == 200 and len(served.content) > 100_000


async def test_swagger_ui_takes_its_script_and_styles_from_the_gateway(gw):
    await assert_served_here(
        gw, "/docs", ["/docs/assets/swagger-ui.css", "/docs/assets/swagger-ui-bundle.js"]
    )


async def test_redoc_takes_its_script_from_the_gateway(gw):
    await assert_served_here(gw, "/redoc", ["/docs/assets/redoc.standalone.js"])


async def test_the_openapi_document_the_pages_read_is_served(gw):
    assert (await gw.client.get("/openapi.json")).json()["info"]["title"] == "rl-gateway"
