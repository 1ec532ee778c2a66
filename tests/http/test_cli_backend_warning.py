"""A backend that does not answer when the gateway starts does not stop it: a warning names the backend and
says that calls are refused while no backend answers (503, which agents' clients retry)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from testbed.process import refusing_port

pytestmark = pytest.mark.anyio


async def test_a_backend_down_at_start_is_a_warning_and_the_gateway_starts(
    start: Callable[..., Awaitable[Any]], caplog: pytest.LogCaptureFixture
):
    backend = f"http://127.0.0.1:{refusing_port()}"  # bound, not listening: connections are refused

    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        gw = await start(backend=[backend], scripted=False)
    started = [record for record in caplog.records if record.name == "gateway.app"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    refused = await gw.client.post("/rollouts/r/v1/chat/completions", json=body)

    assert [(record.levelname, record.getMessage()) for record in started] == [
        (
            "WARNING",
            f"backend {backend} does not answer: the gateway starts without it; calls go to the other "
            "backends, or are refused while none answers",
        )
    ]
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "backend_unavailable")
