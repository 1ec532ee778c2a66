"""A backend that does not answer when the gateway starts does not stop it: a warning names the backend and
says that calls are refused while no backend answers (503, which agents' clients retry)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import Settings

pytestmark = pytest.mark.anyio


async def test_a_backend_down_at_start_is_a_warning_and_the_gateway_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        backend = f"http://127.0.0.1:{closed.getsockname()[1]}"
        app = create_app(Settings(db=f"sqlite:///{tmp_path}/gateway.db", backend=[backend]))

        with caplog.at_level(logging.WARNING, logger="gateway.app"):
            async with app.router.lifespan_context(app):
                started = [record for record in caplog.records if record.name == "gateway.app"]
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as agent:
                    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
                    refused = await agent.post("/rollouts/r/v1/chat/completions", json=body)

    assert [(record.levelname, record.getMessage()) for record in started] == [
        (
            "WARNING",
            f"backend {backend} does not answer: the gateway starts without it; calls go to the other "
            "backends, or are refused while none answers",
        )
    ]
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "backend_unavailable")
