"""Servers on raw sockets for the tests of the gateway's connections to its engines: each answers (or fails
to) at an exact point of an HTTP exchange, as no real server can be made to."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Server], Awaitable[None]]
Serve = Callable[[Handler], Awaitable[str]]


@pytest.fixture(
    name="anyio_backend",
    params=[pytest.param({}, id="asyncio"), pytest.param({"use_uvloop": True}, id="uvloop")],
)
def both_loops(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """Imported by a test module, its tests run on asyncio's loop and on uvloop, which the gateway serves on:
    the two differ in when they call a protocol's callbacks."""
    return "asyncio", request.param


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def answers(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _server: asyncio.Server
) -> None:
    """A server that answers every request on a connection."""
    try:
        while True:
            await read_request(reader)
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionResetError):  # the client closed the connection
        writer.close()


class Counted:
    """A handler that counts the connections it has taken (`connections`), then hands each to `handler`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0

    async def __call__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        self.connections += 1
        await self.handler(reader, writer, server)


@asynccontextmanager
async def raw_servers() -> AsyncIterator[Serve]:
    """`await serve(handler)`: the URL of a server on a free port whose every connection `handler` takes."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await handler(reader, writer, server)

        server = await asyncio.start_server(connected, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    try:
        yield start
    finally:
        for server in servers:
            server.close()
