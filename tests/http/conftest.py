"""The in-process tier: `create_app` on a fresh SQLite store and a scripted engine, driven through
`httpx.ASGITransport` (no socket, no subprocess, no vLLM)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from gateway.store.store import Store
from rollout_store.database import ensure_schema

from support.fake_engine import URL, FakeEngine, Scripted
from support.raw_http import Serve, raw_servers


@dataclass
class InProcess:
    client: httpx.AsyncClient
    engine: FakeEngine
    app: Any
    db: str
    """The store's URL, for reading it as a trainer does."""

    async def rollout(self, rollout_id: str, **params: Any) -> dict[str, Any]:
        """The rollout as the control API shows it, token arrays included."""
        answer = await self.client.get(f"/rollouts/{rollout_id}", params={"include_tokens": "true", **params})
        assert answer.status_code == 200, answer.text
        return answer.json()

    async def chat(self, rollout_id: str, **body: Any) -> httpx.Response:
        body.setdefault("model", "tiny")
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        return await self.client.post(f"/rollouts/{rollout_id}/v1/chat/completions", json=body)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """`await serve(handler)`: a raw-socket server's URL (`raw_http`)."""
    async with raw_servers() as start:
        yield start


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, made once and copied for each test."""
    path = tmp_path_factory.mktemp("template") / "gateway.db"
    ensure_schema(f"sqlite:///{path}")
    return path


@pytest.fixture
async def start(tmp_path: Path, empty_store: Path) -> AsyncIterator[Callable[..., Awaitable[InProcess]]]:
    """`await start(**settings)`: a gateway app with its own engine, on a store of its own or on the migrated
    store `db` names (which several apps may share, as a gateway's processes do), running until the test
    ends."""
    async with AsyncExitStack() as stack:
        count = 0

        async def started(**settings: Any) -> InProcess:
            nonlocal count
            if "db" not in settings:
                count += 1
                path = tmp_path / f"gateway-{count}.db"
                shutil.copy(empty_store, path)
                settings["db"] = f"sqlite:///{path}"
            url = settings["db"]
            store, scripted = Store(url), Scripted()
            stack.callback(store.close)
            settings = {"backend": [URL]} | settings
            app = create_app(Settings(**settings), store=store, engine=scripted)
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://gateway")
            )
            return InProcess(client, scripted.engine, app, url)

        yield started


@pytest.fixture
async def gw(start: Callable[..., Awaitable[InProcess]]) -> InProcess:
    """A gateway with the default settings."""
    return await start()
