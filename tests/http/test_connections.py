"""Each server's connections (`gateway.fleet.connections`): a server takes `--max-connections` calls at once
and the next waits in the queue for a slot given back, then goes on the connection that call left idle; the
idle connection reused is the most recently used, one past the keep-alive time or closed is closed instead;
a removed server's connections are closed, idle ones at once, busy ones when their call ends, and a server of
that URL added again starts with a pool of its own. The pool's own tests keep connections that are no more
than what it asks of one (`Reusable`); the engine client's run on raw-socket servers, on asyncio's loop and on
uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import pytest

from gateway.fleet.connections import Pool, Pools

from support import until
from support.fleets import engine_client
from support.raw_http import ANSWER, Counted, Serve, answers, both_loops, read_request  # noqa: F401 (both_loops: both loops)

pytestmark = pytest.mark.anyio


@dataclass(eq=False)
class Kept:
    """A connection as a pool knows it."""

    name: str
    idle_since: float
    open: bool = True

    def close(self) -> None:
        self.open = False


async def test_the_most_recently_used_idle_connection_is_reused_first():
    pool: Pool[Kept] = Pool(limit=4, keepalive=60)
    now = time.monotonic()
    for name in ("older", "newer"):
        pool.keep(Kept(name, now))

    reused = [pool.reuse(), pool.reuse(), pool.reuse()]

    assert [kept and kept.name for kept in reused] == ["newer", "older", None]


async def test_an_idle_connection_past_the_keepalive_time_or_closed_by_the_server_is_closed_not_reused():
    pool: Pool[Kept] = Pool(limit=4, keepalive=60)
    now = time.monotonic()
    stale, fresh, gone = Kept("stale", now - 61), Kept("fresh", now), Kept("gone", now)
    gone.open = False  # the server closed it while it was idle
    for kept in (stale, fresh, gone):
        pool.keep(kept)

    first, second = pool.reuse(), pool.reuse()

    assert (first, second) == (fresh, None)
    assert [(kept.name, kept.open) for kept in (stale, fresh, gone)] == [
        ("stale", False),
        ("fresh", True),
        ("gone", False),
    ]


async def test_a_closed_connection_dropped_from_the_idle_ones_is_not_reused():
    pool: Pool[Kept] = Pool(limit=4, keepalive=60)
    kept = Kept("kept", time.monotonic())
    pool.keep(kept)
    pool.drop(kept)

    assert pool.reuse() is None


async def test_a_pool_holds_its_limit_of_slots_and_a_call_past_them_waits_for_one_given_back():
    pool: Pool[Kept] = Pool(limit=2, keepalive=60)
    await pool.take()
    await pool.take()
    third = asyncio.ensure_future(pool.take())
    await until(lambda: pool.full and not third.done(), "the third call waiting")
    pool.give_back()
    await third

    assert pool.full


async def test_a_forgotten_servers_idle_connections_are_closed_and_its_url_added_again_has_a_new_pool():
    pools: Pools[Kept] = Pools(limit=1, keepalive=60)
    old = pools.of("http://s0")
    kept = Kept("kept", time.monotonic())
    old.keep(kept)
    await old.take()
    pools.forget("http://s0")
    new = pools.of("http://s0")

    assert (kept.open, old.retired, new is old, new.retired, new.full, new.reuse()) == (
        False,
        True,
        False,
        False,
        False,
        None,
    )


async def test_a_server_takes_max_connections_calls_and_the_next_waits_then_reuses_the_connection_let_go(
    serve: Serve,
):
    requests: list[bytes] = []
    go = asyncio.Semaphore(0)

    async def answers_when_told(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionResetError):
            while True:  # until the client closes the connection
                requests.append(await read_request(reader))
                await go.acquire()
                writer.write(ANSWER)

    counted = Counted(answers_when_told)
    url = await serve(counted)
    pool = engine_client([url], timeout=60, connect_timeout=60, max_connections=2, max_queued=16)

    async def call(rollout_id: str) -> bytes:
        routed = await pool.send(rollout_id, "/v1/completions", b"{}")
        return await routed.reply.body()

    try:
        calls = [asyncio.ensure_future(call(f"r{i}")) for i in range(3)]
        await until(lambda: len(requests) == 2 and pool.queued == 1, "two calls sent, the third queued")
        held = (len(requests), counted.connections, pool.queued)
        go.release()  # one call answered and let go: the queued one takes its slot and its connection
        await until(lambda: len(requests) == 3, "the queued call sent")
        go.release()
        go.release()
        bodies = await asyncio.gather(*calls)
    finally:
        await pool.close()

    assert held == (2, 2, 1)
    assert (bodies, counted.connections, pool.queued, pool.fleet.servers[url].in_flight) == (
        [b"{}"] * 3,
        2,
        0,
        0,
    )


async def test_a_removed_servers_connections_are_closed_idle_ones_at_once_busy_ones_when_their_call_ends(
    serve: Serve,
):
    closed: list[bool] = []

    async def answers_then_notes_the_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        await answers(reader, writer, server)
        closed.append(True)

    url = await serve(answers_then_notes_the_close)
    pool = engine_client([url], timeout=60, connect_timeout=60, max_connections=4, max_queued=16)
    try:
        idle, busy = await asyncio.gather(*(pool.send(f"r{i}", "/v1/completions", b"{}") for i in range(2)))
        assert await idle.reply.body() == b"{}"  # its connection idle again, the other still out
        pool.fleet.remove(url)
        await until(lambda: len(closed) == 1, "the idle connection closed")
        assert await busy.reply.body() == b"{}"
        await until(lambda: len(closed) == 2, "the busy connection closed once its call ended")
    finally:
        await pool.close()
