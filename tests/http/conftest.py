"""The in-process tier: `create_app` on a fresh SQLite store and a scripted engine, or its own engine client
calling the test's raw-socket servers, driven through `httpx.ASGITransport` (no subprocess, no vLLM)."""

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


class Lifespan:
    """An app's lifespan, ended once: by a test of what a gateway does as it stops, else as the test ends."""

    def __init__(self, app: Any) -> None:
        self._context = app.router.lifespan_context(app)
        self._stopped = False

    async def start(self) -> None:
        await self._context.__aenter__()

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await self._context.__aexit__(None, None, None)


@dataclass
class InProcess:
    client: httpx.AsyncClient
    app: Any
    db: str
    """The store's URL, for reading it as a trainer does."""
    lifespan: Lifespan
    scripted: Scripted | None

    @property
    def engine(self) -> FakeEngine:
        """The scripted engine the test answers for (an app started with `scripted=False` has none)."""
        assert self.scripted is not None, "this app calls its backends through its own engine client"
        return self.scripted.engine

    async def stop(self) -> None:
        """Shut the app down as a signal stops a gateway: this returns once its streams have finished."""
        await self.lifespan.stop()

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
    ends. The engine is scripted, or with `scripted=False` the gateway's own engine client, which checks
    and calls the servers `backend` names as a gateway in production does."""
    async with AsyncExitStack() as stack:
        count = 0

        async def started(*, scripted: bool = True, **settings: Any) -> InProcess:
            nonlocal count
            if "db" not in settings:
                count += 1
                path = tmp_path / f"gateway-{count}.db"
                shutil.copy(empty_store, path)
                settings["db"] = f"sqlite:///{path}"
            url = settings["db"]
            store, engine = Store(url), Scripted() if scripted else None
            stack.callback(store.close)
            if engine is not None:
                settings = {"backend": [URL]} | settings
            app = create_app(Settings(**settings), store=store, engine=engine)
            lifespan = Lifespan(app)
            await lifespan.start()
            stack.push_async_callback(lifespan.stop)
            transport = httpx.ASGITransport(app=app)
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://gateway")
            )
            return InProcess(client, app, url, lifespan, engine)

        yield started


@pytest.fixture
async def gw(start: Callable[..., Awaitable[InProcess]]) -> InProcess:
    """A gateway with the default settings."""
    return await start()
