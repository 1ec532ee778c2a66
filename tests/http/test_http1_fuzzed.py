"""The turn path's HTTP/1.1 client (`gateway.fleet.http1`), through the engine client, fed byte streams
Hypothesis draws: replies with a length, chunked or running to the close, after interim 1xx replies, split
into writes at any points, followed in the write that ends them by nothing, blank lines, stray bytes or
another whole reply, or cut short, or not HTTP at all. Whatever comes, a call gets its own reply whole (when
the server wrote it whole) or the gateway's error, never another call's bytes nor an exception of another
kind. Each call's body names the call, so a reply read by the wrong call shows. The examples are derandomized:
the same on every run."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass
from typing import Literal

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fleet.engine import EngineClient
from gateway.fleet.replies import BackendFailure, BackendStreamError

from support.fleets import engine_client
from support.raw_http import both_loops, raw_servers, read_request  # noqa: F401 (both_loops: both loops)

pytestmark = pytest.mark.anyio

INTERIM = [
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
]
STRAY_REPLY = b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n<stray>"


@dataclass(frozen=True)
class Script:
    """What the server writes for one call, and how its caller reads it."""

    status: int
    body: bytes
    """Names its call: `<call:...>`."""
    wire: bytes
    """The interim replies, then the reply, as framed."""
    framed: bool
    """With a length or chunked: not ended by the connection's close."""
    ending: Literal["whole", "cut", "not http"]
    """Cut: the server closes the connection after `cut` bytes of the wire."""
    cut: int
    after: bytes
    """Written with the reply's last bytes, past its end."""
    splits: tuple[int, ...]
    """Where the wire is split into writes."""
    let_go_at: int | None
    """The caller lets the reply go (as at a stream's [DONE]) once it has this many bytes; None: it reads to
    the end."""

    def writes(self) -> list[bytes]:
        if self.ending == "not http":
            return [b"X" + self.after]
        sent = self.wire[: self.cut] if self.ending == "cut" else self.wire
        points = [0, *(point for point in self.splits if point < len(sent)), len(sent)]
        pieces = [sent[start:end] for start, end in itertools.pairwise(points)]
        if self.ending == "whole":
            pieces[-1] += self.after
        return pieces

    @property
    def closes(self) -> bool:
        """The server closes the connection once it has written this."""
        return self.ending == "cut" or not self.framed


def chunked(body: bytes, cuts: list[int], extension: bool, upper: bool) -> bytes:
    points = [0, *sorted(set(cuts)), len(body)]
    pieces = [body[start:end] for start, end in itertools.pairwise(points) if end > start]
    size = b"%X" if upper else b"%x"
    extra = b";name=value" if extension else b""
    framed = b"".join(size % len(piece) + extra + b"\r\n" + piece + b"\r\n" for piece in pieces)
    return framed + b"0\r\n\r\n"


@st.composite
def scripts(draw: st.DrawFn, call: int) -> Script:
    status = draw(st.sampled_from([200, 200, 400, 500]))
    body = b"<%d:" % call + draw(st.binary(max_size=300)) + b">"
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    head = b"HTTP/1.1 %d Reply\r\ncontent-type: application/json\r\n" % status
    if framing == "length":
        reply = head + b"content-length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        cuts = draw(st.lists(st.integers(1, len(body) - 1), max_size=6))
        framed = chunked(body, cuts, draw(st.booleans()), draw(st.booleans()))
        reply = head + b"transfer-encoding: chunked\r\n\r\n" + framed
    else:
        reply = head + b"\r\n" + body
    wire = b"".join(draw(st.lists(st.sampled_from(INTERIM), max_size=2))) + reply
    ending = draw(st.sampled_from(["whole", "whole", "whole", "cut", "not http"]))
    after = b""
    if ending == "whole" and framing != "close":  # past a body run to the close is more of the body
        after = draw(st.sampled_from([b"", b"\r\n", STRAY_REPLY, b"garbage"]))
        if after == b"garbage":
            after = draw(st.binary(min_size=1, max_size=16))
    elif ending == "not http":
        after = draw(st.binary(max_size=16))
    return Script(
        status=status,
        body=body,
        wire=wire,
        framed=framing != "close",
        ending=ending,
        cut=draw(st.integers(0, len(wire) - 1)),
        after=after,
        splits=tuple(sorted(draw(st.sets(st.integers(1, len(wire) - 1), max_size=4)))),
        let_go_at=draw(st.none() | st.integers(0, len(body))),
    )


calls = st.integers(1, 4).flatmap(lambda n: st.tuples(*(scripts(call) for call in range(n))))


async def a_turn_of_the_loop() -> None:
    """Lets the client's end read what was written before the next write: the writes arrive as separate
    reads."""
    loop = asyncio.get_running_loop()
    turned = loop.create_future()
    loop.call_soon(turned.set_result, None)
    await turned


class Server:
    """Plays each call's script on the connection its request comes on, until the client closes it."""

    def __init__(self, scripts: tuple[Script, ...]) -> None:
        self.scripts = scripts
        self.playing: list[tuple[asyncio.Task[None], asyncio.StreamWriter]] = []

    async def __call__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.playing.append((task, writer))
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            while True:
                request = await read_request(reader)
                script = self.scripts[orjson.loads(request.partition(b"\r\n\r\n")[2])["call"]]
                for piece in script.writes():
                    if writer.is_closing():  # by `stop`
                        return
                    writer.write(piece)
                    await writer.drain()
                    await a_turn_of_the_loop()
                if script.closes:
                    break
        writer.close()

    async def stop(self) -> None:
        """Closes the connections the client left open (a reply let go whose end had not come yet)."""
        for _, writer in self.playing:
            writer.close()
        await asyncio.gather(*(task for task, _ in self.playing))


async def outcome(pool: EngineClient, call: int, script: Script) -> tuple[int, bytes] | Exception:
    """The call's status and what it read of the body, or the gateway's error."""
    try:
        routed = await pool.send("r", "/v1/completions", orjson.dumps({"call": call}))
    except BackendFailure as failure:
        return failure
    reply, reads = routed.reply, b""
    try:
        if script.let_go_at is None:
            reads = await reply.body()
        else:
            while len(reads) < script.let_go_at and (data := await reply.read()):
                reads += data
            reply.ended()
    except BackendStreamError as broke:
        return broke
    finally:
        reply.close()  # once let go, a no-op
    return reply.status, reads


@settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
)
@given(scripts=calls)
async def test_each_call_gets_its_own_whole_reply_or_the_gateways_error_whatever_the_server_writes(
    scripts: tuple[Script, ...],
):
    server = Server(scripts)
    async with raw_servers() as serve:
        url = await serve(server)
        pool = engine_client([url], timeout=10, connect_timeout=10, max_connections=4, max_queued=16)
        try:
            outcomes = [await outcome(pool, call, script) for call, script in enumerate(scripts)]
        finally:
            await pool.close()
            await server.stop()

    for script, got in zip(scripts, outcomes, strict=True):
        if isinstance(got, Exception):  # the gateway's error: no other kind is caught
            assert script.ending != "whole", f"{script}: {got!r}"
            continue
        status, body = got
        assert (status, body) == (script.status, script.body[: len(body)])  # its own reply, or some of it
        if script.ending == "whole":  # all it read, or all it wanted before letting go
            wanted = script.body if script.let_go_at is None else script.body[: script.let_go_at]
            assert len(body) >= len(wanted)
        else:  # cut short, yet no error: a body run to the close, or a reply let go before the cut
            assert not script.framed or script.let_go_at is not None, f"{script}: {got!r}"
