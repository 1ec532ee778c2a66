"""How the engine client's calls meet a server's connections (`gateway.fleet.engine`): an idle kept-alive
connection the server closed is retried on the same server, but a request a server read on a new connection is
never sent again; a server that dies with a call at work fails that call (it is never re-run elsewhere,
whether the kill reaches the gateway as a close or a reset) and is ejected (at once, or by the next call that
finds it gone), and the rollout's next call moves. A server too busy to accept a connection stays: its call is
refused for the client to retry, and health checks that time out eject it only if another server serves its
models. The servers are raw sockets, to die at an exact point of the exchange, or to accept no connection at
all; each test runs on asyncio's own loop and on uvloop (the server's)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from gateway.fleet.engine import EngineClient
from gateway.fleet.replies import BackendFailure
from testbed.process import refusing_port

from support.fleets import engine_client
from support.raw_http import ANSWER, Counted, Handler, answers, both_loops, read_request  # noqa: F401 (both_loops: both loops)

pytestmark = pytest.mark.anyio


def dies_at_work(reset: bool) -> Handler:
    """A server killed with a request at work: it stops listening and drops the connection, or resets it."""

    async def handle(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        await read_request(reader)
        server.close()
        if reset:  # no lingering: the kernel answers the close with a reset
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        writer.close()

    return handle


@pytest.fixture
async def pool_of() -> AsyncIterator[Callable[..., EngineClient]]:
    pools: list[EngineClient] = []

    def make(*urls: str) -> EngineClient:
        pools.append(
            engine_client(list(urls), timeout=60, connect_timeout=60, max_connections=4, max_queued=16)
        )
        return pools[-1]

    yield make
    for pool in pools:
        await pool.close()


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_server_that_dies_with_a_call_at_work_fails_that_call_is_ejected_and_the_rollout_moves(
    serve, pool_of, reset
):
    dying = await serve(dies_at_work(reset))
    survivor = await serve(answers)
    pool = pool_of(dying, survivor)
    pool.fleet.servers[survivor].pinned = 1  # the new rollout goes to the dying server, the least loaded

    with pytest.raises(BackendFailure) as failed:
        await pool.send("r", "/v1/chat/completions", b"{}")
    moved = await pool.send("r", "/v1/chat/completions", b"{}")
    await moved.reply.body()

    assert (failed.value.kind, failed.value.url) == ("failed", dying)
    assert (moved.url, moved.repinned_from) == (survivor, dying)
    assert [(s.healthy, s.in_flight) for s in pool.fleet.servers.values()] == [(False, 0), (True, 0)]
    assert pool.fleet.servers[survivor].requests == 1  # the failed call was not re-run there


async def test_an_idle_connection_the_server_closed_is_retried_on_the_same_server(serve, pool_of):
    async def closes_its_first_connection_once_idle(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        if (
            counted.connections == 1
        ):  # answers, then closes the kept-alive connection as the next request arrives
            await read_request(reader)
            writer.write(ANSWER)
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            writer.close()
            return
        await answers(reader, writer, server)

    counted = Counted(closes_its_first_connection_once_idle)
    url = await serve(counted)
    pool = pool_of(url)

    for _ in range(2):
        routed = await pool.send("r", "/v1/chat/completions", b"{}")
        assert await routed.reply.body() == b"{}"

    assert counted.connections == 2
    assert (pool.fleet.servers[url].healthy, pool.fleet.servers[url].errors, routed.repinned_from) == (
        True,
        0,
        None,
    )


async def test_a_call_whose_new_connection_closes_after_the_request_went_out_is_not_sent_again(
    serve, pool_of
):
    requests: list[bytes] = []

    async def reads_then_drops(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        requests.append(await read_request(reader))  # the generation may have begun: it must not run twice
        writer.close()

    url = await serve(reads_then_drops)
    pool = pool_of(url)
    with pytest.raises(BackendFailure) as failed:
        await pool.send("r", "/v1/chat/completions", b"{}")

    assert (failed.value.kind, len(requests)) == ("failed", 1)
    assert str(failed.value) == f"backend {url} failed: connection closed before the reply"
    assert (pool.fleet.servers[url].healthy, pool.fleet.servers[url].in_flight) == (True, 0)


UNANSWERED = 0.2
"""The connect timeout towards a busy server: its handshakes are never answered, so however slow the machine,
the wait ends in a timeout, and a short one keeps the tests short."""


@pytest.fixture
def busy_server() -> Iterator[str]:
    """A server that accepts no more connections: its accept queue (listen backlog 0) is full, so a new
    connection's handshake is never answered, as for a server too busy to accept."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(3):  # more than the queue holds; the handshakes of the last ones hang, unanswered
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        queued.append(client)
    yield f"http://127.0.0.1:{port}"
    for client in queued:
        client.close()
    listener.close()


async def test_a_server_too_busy_to_accept_a_connection_stays_in_the_fleet_and_the_call_is_refused_to_retry(
    busy_server,
):
    pool = engine_client(
        [busy_server], timeout=5, connect_timeout=UNANSWERED, max_connections=4, max_queued=16
    )
    try:
        with pytest.raises(BackendFailure) as refused:
            await pool.send("r", "/v1/chat/completions", b"{}")
    finally:
        await pool.close()

    assert (refused.value.kind, refused.value.url) == ("busy", busy_server)
    assert str(refused.value) == (
        f"backend {busy_server} did not accept a connection within 0.2 s: it is busy, not gone; retry"
    )
    server = pool.fleet.servers[busy_server]
    assert (server.healthy, server.in_flight, server.errors) == (True, 0, 1)


async def checked_twice(pool: EngineClient, url: str) -> bool | None:
    """What two health checks in a row (the default ejection) find of a server's health."""
    await pool.check(pool.fleet.servers[url])
    return (await pool.check(pool.fleet.servers[url])).healthy


async def test_health_checks_that_time_out_do_not_eject_the_last_server_of_a_model(busy_server):
    pool = engine_client(
        [busy_server], timeout=5, connect_timeout=UNANSWERED, max_connections=4, max_queued=16
    )
    try:
        assert await checked_twice(pool, busy_server) is None  # no change: it stays in service
    finally:
        await pool.close()
    assert pool.fleet.servers[busy_server].failed_checks == 2


async def test_health_checks_that_time_out_eject_a_server_whose_models_another_serves(busy_server, serve):
    other = await serve(answers)
    pool = engine_client(
        [busy_server, other], timeout=5, connect_timeout=UNANSWERED, max_connections=4, max_queued=16
    )
    try:
        assert await checked_twice(pool, busy_server) is False
    finally:
        await pool.close()


async def test_health_checks_refused_eject_even_the_last_server():
    refused = f"http://127.0.0.1:{refusing_port()}"  # nothing listens there: refused at once, however slow
    pool = engine_client([refused], timeout=5, connect_timeout=60, max_connections=4, max_queued=16)
    try:
        assert await checked_twice(pool, refused) is False
    finally:
        await pool.close()
