"""The leader goes first: a declared group's first calls that reach one server with one prompt have it
computed once, by a copy of the first asking for one token, and the others sent only once it has been
answered; later calls, and groups without a declared size, go straight through. The copy has a short bound of
its own, the wait for it counts against each call's timeout, and the calls waiting for it are queued calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import orjson
import pytest

from gateway.fleet.engine import EngineClient
from gateway.fleet.leaders import Ahead, Leaders
from gateway.fleet.replies import BackendFailure

from support import until
from support.fake_engine import chat_reply, chat_stream
from support.fleets import engine_client
from support.raw_http import Serve, read_request

pytestmark = pytest.mark.anyio


async def unqueued(wait: Callable[[], Awaitable[object]]) -> None:
    await wait()


async def create(gw, rollout_id: str, **fields: object) -> None:
    answer = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, "group_id": "g", **fields})
    assert answer.status_code == 201, answer.text


async def call(gw, rollout_id: str, **body: object) -> None:
    streamed = chat_stream([1, 2], [(3, "ok")]) if body.get("stream") else chat_reply([1, 2], [3], "ok")
    gw.engine.answer("/v1/chat/completions", streamed)
    answer = await gw.chat(rollout_id, max_tokens=64, min_tokens=8, logprobs=True, **body)
    assert answer.status_code == 200, answer.text


async def test_a_declared_groups_first_calls_send_their_prompt_ahead_and_later_calls_do_not(gw):
    for member in ("a", "b"):
        await create(gw, member, group_size=2)

    await call(gw, "a", seed=1, stream=True)
    await call(gw, "b", seed=2)
    await call(gw, "a", seed=1)

    (first, led), (second, followed) = gw.engine.aheads
    assert (first, second) == ("a", "b")
    assert led.prompt == followed.prompt  # the seed and streaming shape no prompt
    assert led.path == "/v1/chat/completions"
    copy = orjson.loads(led.copy)
    assert copy["max_tokens"] == 1
    assert not {"stream", "stream_options", "min_tokens", "logprobs"} & copy.keys()
    assert copy["messages"] == [{"role": "user", "content": "hi"}]


async def test_calls_of_groups_without_a_declared_size_or_with_leader_first_off_go_straight(start):
    undeclared, off = await start(), await start(leader_first=False)
    await create(undeclared, "a")
    await create(off, "a", group_size=2)

    await call(undeclared, "a")
    await call(off, "a")

    assert (undeclared.engine.aheads, off.engine.aheads) == ([], [])


async def test_calls_with_one_prompt_on_one_server_wait_for_the_one_that_computes_it():
    leaders, computed, release = Leaders(), [], asyncio.Event()

    async def compute() -> None:
        computed.append("prompt")
        await release.wait()

    ahead = Ahead("p", "/v1/chat/completions", b"{}")
    calls = [asyncio.create_task(leaders.first("http://s0", ahead, compute, unqueued)) for _ in range(3)]
    other_server = asyncio.create_task(leaders.first("http://s1", ahead, compute, unqueued))
    other_prompt = asyncio.create_task(leaders.first("http://s0", Ahead("q", "", b""), compute, unqueued))
    await until(lambda: len(computed) == 3, "each server's and each prompt's computation to start")
    waiting = [task.done() for task in calls]

    release.set()
    await asyncio.gather(*calls, other_server, other_prompt)

    assert waiting == [False, False, False]
    assert (leaders.led, leaders.followed) == (3, 2)


async def test_a_copy_that_fails_lets_the_calls_behind_it_go_on():
    leaders, started, fail = Leaders(), asyncio.Event(), asyncio.Event()

    async def fails() -> None:
        started.set()
        await fail.wait()
        raise OSError("reset")

    ahead = Ahead("p", "", b"")
    first = asyncio.create_task(leaders.first("http://s0", ahead, fails, unqueued))
    await started.wait()
    behind = asyncio.create_task(leaders.first("http://s0", ahead, fails, unqueued))
    await until(lambda: leaders.followed == 1, "the second call waiting for the first's copy")
    fail.set()
    await asyncio.gather(first, behind)

    assert (leaders.led, leaders.followed) == (1, 1)


async def test_the_server_gets_the_copy_alone_then_every_call_of_the_group(serve: Serve):
    seen: list[bytes] = []
    answer_copy = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        try:
            while True:
                body = (await read_request(reader)).partition(b"\r\n\r\n")[2]
                seen.append(body)
                if body == b'{"copy":1}':
                    await answer_copy.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            writer.close()

    url = await serve(engine)
    pool = engine_client([url], timeout=60, connect_timeout=60, max_connections=8, max_queued=16)
    pool.fleet.servers[url].healthy = True
    ahead = Ahead("p", "/v1/chat/completions", b'{"copy":1}')
    try:
        calls = [
            asyncio.create_task(pool.send(f"r{i}", "/v1/chat/completions", b'{"call":%d}' % i, ahead=ahead))
            for i in range(3)
        ]
        await until(lambda: pool.fleet.leaders.followed == 2 and seen, "two calls waiting behind the copy")
        while_computing = list(seen)
        answer_copy.set()
        bodies = [await routed.reply.body() for routed in await asyncio.gather(*calls)]
    finally:
        await pool.close()

    assert while_computing == [b'{"copy":1}']
    assert sorted(seen[1:]) == [b'{"call":0}', b'{"call":1}', b'{"call":2}']
    assert bodies == [b"{}"] * 3
    assert [server.in_flight for server in pool.fleet.servers.values()] == [0]


COPY = b'{"copy":1}'


def engine_seeing(seen: list[bytes], answers: Callable[[bytes], Awaitable[bool]]):
    """A server that records each request's body, then answers it `{}` once `answers` says to, or never."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        try:
            while True:
                body = (await read_request(reader)).partition(b"\r\n\r\n")[2]
                seen.append(body)
                if await answers(body):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            writer.close()

    return engine


async def never(_: bytes) -> bool:
    await asyncio.Event().wait()
    return False


def group_calls(pool: EngineClient, members: int) -> list[asyncio.Task]:
    ahead = Ahead("p", "/v1/chat/completions", COPY)
    return [
        asyncio.create_task(pool.send(f"r{i}", "/v1/chat/completions", b'{"call":%d}' % i, ahead=ahead))
        for i in range(members)
    ]


async def test_a_group_whose_server_never_answers_fails_within_one_backend_timeout(serve: Serve):
    seen: list[bytes] = []
    url = await serve(engine_seeing(seen, never))
    pool = engine_client([url], timeout=4, connect_timeout=60, max_connections=8, max_queued=16)
    started = time.monotonic()
    try:
        failures = await asyncio.gather(*group_calls(pool, 3), return_exceptions=True)
    finally:
        await pool.close()
    took = time.monotonic() - started

    assert [(f.kind, str(f)) for f in failures if isinstance(f, BackendFailure)] == [
        ("timeout", f"backend {url} timed out")
    ] * 3
    assert seen[0] == COPY  # the copy, given up at its bound: then each call, within what is left
    assert sorted(seen[1:]) == [b'{"call":0}', b'{"call":1}', b'{"call":2}']
    # One timeout and some (the copy's bound is spent within it); waiting for the copy, then for the reply,
    # took two (8 s) before: the margin is a loaded machine's.
    assert took < 6


async def test_a_copy_left_unanswered_holds_its_group_only_for_its_own_short_bound(serve: Serve):
    async def all_but_the_copy(body: bytes) -> bool:
        return body != COPY or await never(body)

    seen: list[bytes] = []
    url = await serve(engine_seeing(seen, all_but_the_copy))
    pool = engine_client([url], timeout=6, connect_timeout=60, max_connections=8, max_queued=16)
    started = time.monotonic()
    try:
        bodies = [await routed.reply.body() for routed in await asyncio.gather(*group_calls(pool, 3))]
    finally:
        await pool.close()
    took = time.monotonic() - started

    assert bodies == [b"{}"] * 3
    assert seen[0] == COPY
    # The copy's bound is a tenth of the timeout (0.6 s); it held its group the whole timeout (6 s) before:
    # half of it leaves a loaded machine its margin.
    assert took < 3


async def test_calls_waiting_for_their_groups_copy_are_queued_and_refused_past_max_queued(serve: Serve):
    seen: list[bytes] = []
    answer_copy = asyncio.Event()

    async def copy_when_told(body: bytes) -> bool:
        if body == COPY:
            await answer_copy.wait()
        return True

    url = await serve(engine_seeing(seen, copy_when_told))
    pool = engine_client([url], timeout=60, connect_timeout=60, max_connections=8, max_queued=1)
    try:
        leader, behind = group_calls(pool, 2)
        await until(lambda: pool.fleet.leaders.followed == 1, "the second call waiting behind the copy")
        queued = pool.queued
        third = asyncio.create_task(
            pool.send("r2", "/v1/chat/completions", b"{}", ahead=Ahead("p", "/v1/chat/completions", COPY))
        )
        await until(
            lambda: third.done() or pool.fleet.leaders.followed == 2, "the third call refused or waiting"
        )
        answer_copy.set()
        results = await asyncio.gather(leader, behind, third, return_exceptions=True)
    finally:
        await pool.close()

    assert queued == 1
    refused = results[2]
    assert isinstance(refused, BackendFailure)
    assert (refused.kind, str(refused)) == (
        "queue_full",
        "1 calls already wait for a connection to a backend (--max-queued 1); retry",
    )
    assert [await routed.reply.body() for routed in results[:2]] == [b"{}", b"{}"]
    assert (pool.queued, sorted(seen)) == (0, [b'{"call":0}', b'{"call":1}', COPY])
