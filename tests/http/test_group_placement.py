"""A large group started at once through the gateway, over servers of its own: its members fill one server to
the group's bound, then the next, and the gateway's metrics say why."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from support.fake_engine import chat_completion
from support.raw_http import Handler, Serve

pytestmark = pytest.mark.anyio

REPLY = orjson.dumps(chat_completion([1, 2], [3], "ok"))


def engine(calls: Counter[str], name: str) -> Handler:
    """A server answering every chat completion, and nothing else (no exact mode), counting the calls."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in lines
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if lines[0].split()[1] == b"/v1/chat/completions":
                    calls[name] += 1
                    status, body = b"200 OK", REPLY
                else:
                    status, body = b"404 Not Found", b"{}"
                writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            writer.close()

    return serve


async def test_twelve_rollouts_of_one_group_started_at_once_on_three_idle_servers_go_eight_and_four(
    serve: Serve, start: Callable[..., Awaitable[Any]]
):
    calls: Counter[str] = Counter()
    urls = [await serve(engine(calls, f"s{i}")) for i in range(3)]
    agent = (await start(backend=urls, scripted=False)).client
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}

    for m in range(12):
        created = await agent.post("/rollouts", json={"rollout_id": f"r{m}", "group_id": "eval"})
        assert created.status_code == 201, created.text
    answers = await asyncio.gather(
        *(agent.post(f"/rollouts/r{m}/v1/chat/completions", json=body) for m in range(12))
    )
    metrics = (await agent.get("/metrics")).text

    assert [answer.status_code for answer in answers] == [200] * 12
    assert sorted(calls.values()) == [4, 8]
    placed = {
        line.split('reason="')[1].split('"')[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("gateway_placements_total{")
    }
    assert placed == {"load": 1.0, "group": 7.0, "overflow": 4.0}
