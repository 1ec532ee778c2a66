"""A server that comes back takes calls at once: when no healthy server is left for a call, the ejected ones
are checked there and then (one check at a time on each server, whatever the calls waiting on it), not at
the next health check; a call refused meanwhile is told which model no server takes. The server is a raw
socket serving vLLM's few routes, stopped and started again on its port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.fleet.replies import BackendFailure
from testbed.process import free_port

from support import until
from support.fake_engine import chat_completion
from support.fleets import engine_client

pytestmark = pytest.mark.anyio


class Engine:
    """vLLM's routes the gateway calls, on a port it can leave and come back to. `hold_health` keeps the
    /health answers until it is set."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_checks = 0
        self.hold_health = asyncio.Event()
        self.hold_health.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    def down(self) -> None:
        """Stop listening and drop every connection: a call or check is refused until `up`."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                status, body = await self._answer(head.split(b" ")[1])
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (status, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            writer.close()
        finally:
            self._writers.discard(writer)

    async def _answer(self, path: bytes) -> tuple[int, bytes]:
        if path == b"/health":
            self.health_checks += 1
            await self.hold_health.wait()
            return 200, b""
        if path == b"/v1/models":
            return 200, orjson.dumps({"data": [{"id": "tiny"}]})
        if path == b"/metrics":
            return 200, b""
        if path == b"/v1/chat/completions":
            return 200, orjson.dumps(chat_completion([1, 2], [3], "ok"))
        return 404, b"{}"


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = Engine()
    await engine.up()
    yield engine
    engine.down()


async def test_the_only_server_back_takes_the_next_call_at_once_and_one_refused_meanwhile_names_its_model(
    engine: Engine, start: Callable[..., Awaitable[Any]]
):
    gw = await start(backend=[engine.url], health_interval=3600, scripted=False)
    fleet = gw.app.state.admin.fleet
    await until(lambda: fleet.servers[engine.url].models, "the first health check")

    async def call(rollout_id: str) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        return await gw.client.post(f"/rollouts/{rollout_id}/v1/chat/completions", json=body)

    engine.down()
    ejecting = await call("a")  # its connection refused: the server is ejected
    refused = await call("b")
    await engine.up()
    back = await call("c")
    state = (await gw.client.get("/admin/state")).json()

    assert (ejecting.status_code, ejecting.json()["error"]["code"]) == (503, "backend_unavailable")
    assert (refused.status_code, refused.json()["error"]["message"]) == (
        503,
        f"no healthy backend takes new rollouts for model 'tiny': {engine.url} (ejected)",
    )
    assert (back.status_code, back.json()["choices"][0]["message"]["content"]) == (200, "ok")
    assert [(s["url"], s["healthy"]) for s in state["backends"]] == [(engine.url, True)]


async def test_a_burst_of_calls_with_no_server_left_waits_on_one_check_of_each_ejected_server(engine: Engine):
    pool = engine_client([engine.url], timeout=60, connect_timeout=60, max_connections=8, max_queued=16)
    pool.fleet.servers[engine.url].healthy = False
    engine.hold_health.clear()
    try:
        calls = [
            asyncio.create_task(pool.send(f"r{i}", "/v1/chat/completions", b"{}", "tiny")) for i in range(8)
        ]
        await until(
            lambda: engine.health_checks or all(c.done() for c in calls), "the ejected server checked"
        )
        engine.hold_health.set()
        answers = [await routed.reply.body() for routed in await asyncio.gather(*calls)]
    finally:
        await pool.close()

    assert answers == [orjson.dumps(chat_completion([1, 2], [3], "ok"))] * 8
    assert (engine.health_checks, pool.fleet.servers[engine.url].healthy) == (1, True)


async def test_a_call_no_server_takes_is_refused_naming_its_model_after_the_ejected_server_is_checked(
    engine: Engine,
):
    engine.down()
    pool = engine_client([engine.url], timeout=60, connect_timeout=60, max_connections=8, max_queued=16)
    pool.fleet.servers[engine.url].healthy = False  # ejected before any check told its models
    try:
        with pytest.raises(BackendFailure) as refused:
            await pool.send("r", "/v1/chat/completions", b"{}", "tiny")
    finally:
        await pool.close()
        await engine.up()

    assert (refused.value.kind, str(refused.value)) == (
        "unreachable",
        f"no healthy backend takes new rollouts for model 'tiny': {engine.url} (ejected)",
    )
    assert pool.fleet.servers[engine.url].failed_checks == 1  # checked for the call, refused
