"""The turn path's HTTP/1.1 client (`gateway.fleet.http1`) against raw-socket servers: a reply's body comes
back exactly as sent, its chunked framing stripped, however the network splits it; connections are kept alive
and reused, let go at a stream's end even before its framing's end arrives, and never go back idle with their
reading stopped (over TLS too); an interim 1xx reply is skipped for the final one, so no call reads another's
reply; bytes a server writes past a reply's end leave its call the whole reply and close the connection; what
breaks off, stays silent, switches protocols or is not HTTP is an error the engine client maps, never a hang.
A request larger than the transport's buffer is written as the server reads it, and a reply that comes before
it is all written ends the writing. A connection moves only between the states its life allows. Each test
runs on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
import time
from pathlib import Path

import pytest

from gateway.fleet.engine import EngineClient
from gateway.fleet.http1 import Connection, Http1Client, Life, ReplyTimeout, State
from gateway.fleet.replies import BackendFailure, BackendReply, BackendStreamError

from support import TIMEOUT, until
from support.fleets import engine_client
from support.raw_http import (  # noqa: F401 (both_loops: both loops)
    ANSWER,
    Counted,
    Serve,
    answers,
    both_loops,
    read_request,
    self_signed,
)

pytestmark = pytest.mark.anyio

STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"token": %d}\n\n' % i for i in range(40)] + [b"data: [DONE]\n\n"]
END = b"0\r\n\r\n"
"""The end of a chunked body."""


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


UNENDED = STREAM_HEAD + b"".join(chunk(event) for event in EVENTS)
"""A whole stream up to its [DONE], less the chunked body's end."""


def client(read_timeout: float = 60, keepalive: float = 60) -> Http1Client:
    return Http1Client(
        connect_timeout=60,
        read_timeout=read_timeout,
        keepalive=keepalive,
        max_connections=4,
        authorization=None,
    )


def pool_for(url: str, api_key: str | None = None) -> EngineClient:
    return engine_client(
        [url], timeout=60, connect_timeout=60, max_connections=4, max_queued=16, api_key=api_key
    )


@pytest.fixture
def trusted_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A TLS server's context whose certificate the client trusts, as an operator's would be."""
    context, certificate = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate))
    return context


def numbered(call: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n%d" % call


async def round_trip(url: str) -> None:
    """A call on a connection of its own: by its end, this event loop has read what its other connections
    had waiting in the kernel."""
    other = client()
    assert await BackendReply(await other.post(url, "/v1/completions", b"{}")).body() == b"{}"
    other.close()


async def read_all(connection: Connection) -> list[bytes]:
    reads = []
    while data := await connection.read():
        reads.append(data)
    return reads


@pytest.mark.parametrize("piece", [1, 7, 1 << 20], ids=["byte by byte", "7 bytes a write", "all at once"])
async def test_a_chunked_stream_reads_back_as_the_bytes_sent_without_framing_however_the_network_splits_it(
    serve: Serve, piece: int
):
    sent = UNENDED + END

    async def streams(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        await read_request(reader)
        for start in range(0, len(sent), piece):
            writer.write(sent[start : start + piece])
            await writer.drain()
        await reader.read()  # until the client closes

    engine = client()
    connection = await engine.post(await serve(streams), "/v1/chat/completions", b"{}")
    reads = await read_all(connection)
    engine.close()
    connection.close()

    assert connection.status == 200
    assert b"".join(reads) == b"".join(EVENTS)


async def test_replies_with_a_length_are_read_whole_and_their_connection_serves_the_next_call(serve: Serve):
    counted = Counted(answers)
    url = await serve(counted)
    engine = client()
    bodies = []
    for _ in range(3):
        reply = BackendReply(await engine.post(url, "/v1/chat/completions", b"{}"))
        bodies.append(await reply.body())
    engine.close()

    assert (bodies, counted.connections) == ([b"{}"] * 3, 1)


async def test_a_reply_let_go_with_bytes_unread_leaves_none_of_them_to_the_next_call(serve: Serve):
    async def numbered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        for call in range(2):  # each reply whole in one write: it has all arrived when its head has
            await read_request(reader)
            writer.write(STREAM_HEAD + chunk(b"data: %d\n\n" % call) + END)
        await reader.read()

    counted = Counted(numbered)
    url = await serve(counted)
    engine = client()
    BackendReply(await engine.post(url, "/v1/chat/completions", b"{}")).close()  # none of it read
    second = await BackendReply(await engine.post(url, "/v1/chat/completions", b"{}")).body()
    engine.close()

    assert (second, counted.connections) == (b"data: 1\n\n", 1)


async def test_a_reply_let_go_unread_past_the_high_water_mark_leaves_its_connection_serving_the_next_call(
    serve: Serve,
):
    # One byte past what is held unread before the socket stops being read: the read that completes the
    # reply is the one that stops the reading, however the network splits it.
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n"
    body = b"x" * ((1 << 18) + 1 - len(head % (1 << 18)))
    written: list[asyncio.StreamWriter] = []

    async def large_then_small(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        if not written:  # the first call's reply is large, every other one small
            await read_request(reader)
            written.append(writer)
            writer.write(head % len(body) + body)
        await answers(reader, writer, server)

    url = await serve(large_then_small)
    engine = client(read_timeout=600)
    first = await engine.post(url, "/v1/completions", b"{}")
    await until(lambda: written and written[0].transport.get_write_buffer_size() == 0, "the reply all sent")
    # A round trip on another connection: the reply's bytes, all in the kernel by now, are read meanwhile.
    assert await BackendReply(await client().post(url, "/v1/completions", b"{}")).body() == b"{}"
    BackendReply(first).close()  # none of it read by the caller
    second = await BackendReply(await engine.post(url, "/v1/completions", b"{}")).body()
    engine.close()

    assert second == b"{}"


async def test_when_idle_connections_were_all_closed_by_the_server_the_retry_opens_a_new_one(serve: Serve):
    async def closes_when_reused(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        if counted.connections > 2:
            await answers(reader, writer, server)
            return
        await read_request(reader)  # the first two connections answer once, then close as they are reused
        writer.write(ANSWER)
        with contextlib.suppress(asyncio.IncompleteReadError):  # or as the client closes them itself
            await reader.readuntil(b"\r\n\r\n")
        writer.close()

    counted = Counted(closes_when_reused)
    url = await serve(counted)
    pool = pool_for(url)
    try:
        replies = await asyncio.gather(*(pool.send(f"r{i}", "/v1/completions", b"{}") for i in range(2)))
        assert [await routed.reply.body() for routed in replies] == [b"{}", b"{}"]  # two idle connections
        again = await pool.send("r0", "/v1/completions", b"{}")
        body = await again.reply.body()
    finally:
        await pool.close()

    assert (body, counted.connections, pool.fleet.servers[url].errors) == (b"{}", 3, 0)


PAST_THE_END = {
    "five stray bytes": b"stray",
    "a second reply": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
}
"""What a server may write after a reply's end, in the write that ends it."""


@pytest.mark.parametrize("after", PAST_THE_END.values(), ids=PAST_THE_END.keys())
@pytest.mark.parametrize(
    ("reply", "body"),
    [(ANSWER, b"{}"), (STREAM_HEAD + b"".join(map(chunk, EVENTS)) + END, b"".join(EVENTS))],
    ids=["whole", "streamed"],
)
async def test_bytes_past_a_replys_end_leave_its_call_the_whole_reply_and_close_the_connection(
    serve: Serve, reply: bytes, body: bytes, after: bytes
):
    async def overspills(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionResetError):
            while True:  # until the client closes the connection
                await read_request(reader)
                writer.write(reply + after)

    counted = Counted(overspills)
    url = await serve(counted)
    pool = pool_for(url)
    try:
        bodies = [await (await pool.send("r", "/v1/chat/completions", b"{}")).reply.body() for _ in range(3)]
    finally:
        await pool.close()

    assert (bodies, counted.connections, pool.fleet.servers[url].errors) == ([body] * 3, 3, 0)


async def test_a_stream_let_go_at_done_whose_framings_end_comes_with_another_reply_is_not_reused(
    serve: Serve,
):
    let_go = asyncio.Event()

    async def ends_late_with_another_reply(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        if counted.connections > 1:
            await answers(reader, writer, server)
            return
        await read_request(reader)
        writer.write(UNENDED)
        await let_go.wait()
        writer.write(END + numbered(1))
        await reader.read()

    counted = Counted(ends_late_with_another_reply)
    url = await serve(counted)
    engine = client()
    connection = await engine.post(url, "/v1/chat/completions", b"{}")
    while not (await connection.read()).endswith(b"data: [DONE]\n\n"):
        pass
    BackendReply(connection).ended()
    let_go.set()
    await until(lambda: not connection.open, "the connection closed")
    again = await BackendReply(await engine.post(url, "/v1/chat/completions", b"{}")).body()
    engine.close()

    assert (again, counted.connections) == (b"{}", 2)


async def test_a_stream_let_go_at_done_serves_the_next_call_once_its_framings_end_arrives(serve: Serve):
    let_go = asyncio.Event()

    async def ends_late(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        await read_request(reader)
        writer.write(UNENDED)
        await let_go.wait()  # the body's end comes after the client has let the stream go
        writer.write(END)
        await answers(reader, writer, server)

    counted = Counted(ends_late)
    url = await serve(counted)
    engine = client()
    connection = await engine.post(url, "/v1/chat/completions", b"{}")
    reads = [await connection.read()]
    while not reads[-1].endswith(b"data: [DONE]\n\n"):
        reads.append(await connection.read())
    BackendReply(connection).ended()
    let_go.set()
    await until(lambda: connection.idle_since > 0, "the connection back among the idle ones")
    again = BackendReply(await engine.post(url, "/v1/chat/completions", b"{}"))
    body = await again.body()
    engine.close()

    assert (b"".join(reads), body, counted.connections) == (b"".join(EVENTS), b"{}", 1)


async def test_a_stream_let_go_whose_framings_end_never_comes_is_dropped_after_the_keepalive_time(
    serve: Serve,
):
    closed = asyncio.Event()

    async def never_ends(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        await read_request(reader)
        writer.write(UNENDED)
        assert await reader.read() == b""  # the client closed the connection
        closed.set()

    engine = client(keepalive=0.05)
    connection = await engine.post(await serve(never_ends), "/v1/chat/completions", b"{}")
    while not (await connection.read()).endswith(b"data: [DONE]\n\n"):
        pass
    BackendReply(connection).ended()
    await closed.wait()
    engine.close()

    assert connection.idle_since == 0  # never reused


async def test_a_stream_cut_mid_body_hands_over_what_came_then_breaks_off(serve: Serve):
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunk(EVENTS[0]) + chunk(EVENTS[1]))
        await writer.drain()
        writer.close()

    engine = client()
    reply = BackendReply(await engine.post(await serve(cut), "/v1/chat/completions", b"{}"))
    first = await reply.read()
    with pytest.raises(BackendStreamError) as broke:
        await reply.read()
    reply.close()
    engine.close()

    assert first == EVENTS[0] + EVENTS[1]
    assert str(broke.value) == "backend stream broke off: connection closed mid-reply"


async def test_a_body_with_neither_length_nor_chunks_runs_to_the_close_and_its_connection_is_not_kept(
    serve: Serve,
):
    async def unframed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        writer.write(b'{"whole": ')
        await writer.drain()
        writer.write(b"true}")
        writer.close()

    counted = Counted(unframed)
    url = await serve(counted)
    engine = client()
    bodies = [await BackendReply(await engine.post(url, "/v1/completions", b"{}")).body() for _ in range(2)]
    engine.close()

    assert (bodies, counted.connections) == ([b'{"whole": true}'] * 2, 2)


async def test_a_server_silent_before_its_answer_times_out(serve: Serve):
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        await reader.read()

    engine = client(
        read_timeout=0.2
    )  # nothing ever comes: the timeout ends the wait however slow the machine
    with pytest.raises(ReplyTimeout) as before:
        await engine.post(await serve(silent), "/v1/chat/completions", b"{}")
    engine.close()

    assert str(before.value) == "nothing arrived in 0.2 s"


async def test_a_server_silent_after_its_answer_began_times_out(serve: Serve):
    async def silent_after_head(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD)
        await reader.read()

    # The same timeout first bounds the wait for the head, a few turns of this event loop away: thousands of
    # times what that takes.
    engine = client(read_timeout=3)
    connection = await engine.post(await serve(silent_after_head), "/v1/chat/completions", b"{}")
    with pytest.raises(ReplyTimeout) as mid_reply:
        await connection.read()
    connection.close()
    engine.close()

    assert (connection.status, str(mid_reply.value)) == (200, "nothing arrived in 3 s")


async def test_a_reply_that_is_not_http_fails_the_call_and_leaves_the_server_in_the_fleet(serve: Serve):
    async def speaks_ssh(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await reader.read()

    url = await serve(speaks_ssh)
    pool = pool_for(url)
    try:
        with pytest.raises(BackendFailure) as failed:
            await pool.send("r", "/v1/chat/completions", b"{}")
    finally:
        await pool.close()

    assert (failed.value.kind, failed.value.url) == ("failed", url)
    assert str(failed.value).startswith(f"backend {url} failed: not an HTTP reply: ")
    assert (pool.fleet.servers[url].healthy, pool.fleet.servers[url].in_flight) == (True, 0)


async def test_a_reader_that_falls_behind_stops_reading_the_server_and_loses_nothing(serve: Serve):
    body = bytes(range(256)) * (1 << 17)  # 32 MiB: more than the kernel's buffers on both sides hold
    writing: list[asyncio.Transport] = []

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        await read_request(reader)
        writing.append(writer.transport)  # type: ignore[arg-type]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await reader.read()

    engine = client()
    connection = await engine.post(await serve(floods), "/v1/completions", b"{}")
    # The client stopped reading: what the kernel cannot take waits in the server's own buffer.
    await until(lambda: writing and writing[0].get_write_buffer_size() > 0, "the server's writes held back")
    first = await connection.read()
    rest = await connection.body()
    connection.release()
    engine.close()

    assert len(first) <= 2 * (1 << 18)  # at most the high-water mark and one network read past it
    assert first + rest == body


async def test_calls_name_the_servers_path_prefix_its_host_and_the_gateways_own_key(serve: Serve):
    heads: list[bytes] = []

    async def records(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        heads.append(await read_request(reader))
        writer.write(ANSWER)
        await reader.read()

    url = await serve(records)
    pool = pool_for(url + "/engine/")
    pool_with_key = pool_for(url, api_key="k")
    try:
        for each in (pool, pool_with_key):
            await (await each.send("r", "/v1/chat/completions", b"{}")).reply.body()
    finally:
        await pool.close()
        await pool_with_key.close()

    host = url.removeprefix("http://").encode()
    assert heads == [
        b"POST /engine/v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"content-length: 2\r\n\r\n{}" % host,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"content-length: 2\r\nauthorization: Bearer k\r\n\r\n{}" % host,
    ]


async def test_an_interim_103_is_skipped_and_the_call_gets_its_own_final_reply_not_the_next_calls(
    serve: Serve,
):
    hinted, go_on = asyncio.Event(), asyncio.Event()

    async def hints_first(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
        hinted.set()
        await go_on.wait()  # the final reply in a later read than the interim one
        writer.write(numbered(0))
        await read_request(reader)
        writer.write(numbered(1))
        await reader.read()

    counted = Counted(hints_first)
    url = await serve(counted)
    engine = client()
    first = asyncio.create_task(engine.post(url, "/v1/completions", b"{}"))
    await hinted.wait()
    await round_trip(await serve(answers))  # the 103 read by the client meanwhile
    go_on.set()
    connection = await first
    status = connection.status
    bodies = [await BackendReply(connection).body()]
    bodies.append(await BackendReply(await engine.post(url, "/v1/completions", b"{}")).body())
    engine.close()

    assert (status, bodies, counted.connections) == (200, [b"0", b"1"], 1)


async def test_a_101_switching_protocols_fails_its_call_and_closes_the_connection(serve: Serve):
    closed = asyncio.Event()

    async def upgrades(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n\0\0")
        assert await reader.read() == b""  # the client closed the connection
        closed.set()

    loop_errors: list[str] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _, context: loop_errors.append(context["message"])
    )
    url = await serve(upgrades)
    pool = pool_for(url)
    try:
        with pytest.raises(BackendFailure) as failed:
            await pool.send("r", "/v1/chat/completions", b"{}")
        await closed.wait()
    finally:
        await pool.close()
        asyncio.get_running_loop().set_exception_handler(None)

    assert (failed.value.kind, str(failed.value)) == (
        "failed",
        f"backend {url} failed: the server switched protocols (101), which no call asks for",
    )
    assert (loop_errors, pool.fleet.servers[url].in_flight) == ([], 0)


async def test_a_stream_let_go_while_reading_was_stopped_serves_the_next_call_over_tls(
    serve: Serve, trusted_tls: ssl.SSLContext
):
    # Reading stops past the high-water mark; TLS goes on taking what the network brings, and hands it all
    # over at once when reading resumes (the stream let go): one read of more than the high-water mark, here
    # bringing the stream's end. Over plain TCP no read is that large.
    stream = STREAM_HEAD + chunk(b"data: %s\n\n" % (b"x" * 700_000)) + chunk(EVENTS[-1]) + END
    parts = [stream[:300_000], stream[300_000:500_000], stream[500_000:]]
    other = await serve(answers)
    written: list[asyncio.StreamWriter] = []

    async def streams_in_parts_then_answers(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        if not written:
            await read_request(reader)
            written.append(writer)
            for part in parts:  # each in the client's hands before the next: the reads split as planned
                writer.write(part)
                await writer.drain()
                await until(lambda: writer.transport.get_write_buffer_size() == 0, "the part sent")
                await round_trip(other)
            sent.set()
        await answers(reader, writer, server)

    sent = asyncio.Event()
    url = await serve(streams_in_parts_then_answers, tls=trusted_tls)
    engine = client(read_timeout=TIMEOUT)
    connection = await engine.post(url, "/v1/chat/completions", b"{}")
    await sent.wait()
    BackendReply(connection).ended()
    await until(lambda: connection.idle_since > 0, "the connection back among the idle ones")
    again = await BackendReply(await engine.post(url, "/v1/chat/completions", b"{}")).body()
    engine.close()

    assert again == b"{}"


async def test_the_keepalive_time_of_a_connection_counts_from_its_replys_end_not_from_its_callers_release(
    serve: Serve,
):
    engine = client()
    connection = await engine.post(await serve(answers), "/v1/completions", b"{}")  # the whole reply at once
    ended_by = time.monotonic()
    BackendReply(connection).close()
    engine.close()

    assert 0 < connection.idle_since <= ended_by


def life_at(*path: State) -> Life:
    """A connection's life moved along `path` from NEW."""
    life = Life()
    for state in path:
        life.move(state)
    return life


@pytest.mark.parametrize(
    ("path", "to"),
    [
        ((), State.READING_BODY),  # a reply read on a connection that asked nothing
        (
            (State.AWAITING_HEAD, State.READING_BODY, State.ENDED),
            State.AWAITING_HEAD,
        ),  # asked again, not idle
        (
            (State.AWAITING_HEAD, State.READING_BODY, State.ENDED),
            State.READING_BODY,
        ),  # an ended reply read on
        ((State.AWAITING_HEAD, State.READING_BODY, State.DRAINING), State.ENDED),
        ((State.AWAITING_HEAD, State.CLOSED), State.IDLE),  # a closed connection kept for reuse
        ((State.AWAITING_HEAD, State.CLOSED), State.AWAITING_HEAD),
    ],
    ids=[
        "new to reading",
        "ended to asked",
        "ended to reading",
        "draining to ended",
        "closed to idle",
        "reopened",
    ],
)
async def test_a_move_a_connections_life_does_not_allow_is_refused_and_leaves_its_state(
    path: tuple[State, ...], to: State
):
    life = life_at(*path)
    was = life.state
    with pytest.raises(AssertionError) as refused:
        life.move(to)

    assert (str(refused.value), life.state) == (f"{was.value} to {to.value}", was)


async def test_a_connection_goes_idle_and_back_and_closes_from_any_state_even_closed():
    life = life_at(State.AWAITING_HEAD, State.READING_BODY, State.DRAINING, State.IDLE, State.AWAITING_HEAD)
    life.move(State.CLOSED)
    life.move(State.CLOSED)  # both sides close it, in either order

    assert life.state is State.CLOSED


LARGE = bytes(range(256)) * (1 << 17)
"""32 MiB: more than the kernel's buffers on both sides hold, so the client's transport fills and pauses."""


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest().encode()


async def test_a_request_past_the_transports_buffer_is_written_as_the_server_reads_it_and_arrives_whole(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
):
    flow: list[tuple[str, int]] = []  # each pause and resume of the client's writing, and what was unsent
    limits: list[tuple[int, int]] = []

    def noted(name: str, method: object) -> object:
        def note(connection: Connection) -> None:
            transport = connection._transport
            assert transport is not None
            limits.append(transport.get_write_buffer_limits())
            flow.append((name, transport.get_write_buffer_size()))
            method(connection)  # type: ignore[operator]

        return note

    monkeypatch.setattr(Connection, "pause_writing", noted("paused", Connection.pause_writing))
    monkeypatch.setattr(Connection, "resume_writing", noted("resumed", Connection.resume_writing))

    async def reads_once_paused_then_answers_with_a_digest(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionResetError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
                if length > 1 << 20:  # not read until the client's writing has stopped for it
                    await until(lambda: flow, "the client's writing paused")
                answer = digest(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))

    counted = Counted(reads_once_paused_then_answers_with_a_digest)
    url = await serve(counted)
    engine = client()
    large = await BackendReply(await engine.post(url, "/v1/completions", LARGE)).body()
    small = await BackendReply(await engine.post(url, "/v1/completions", b"{}")).body()
    engine.close()

    assert (large, small, counted.connections) == (digest(LARGE), digest(b"{}"), 1)
    assert [name for name, _ in flow] == ["paused", "resumed"] * (len(flow) // 2)
    high = max(high for _, high in limits)
    # Each piece of the body (1 MiB) handed over while the transport held no more than its high-water mark.
    assert max(held for _, held in flow) <= high + (1 << 20) + 200


async def test_a_reply_that_comes_before_a_large_request_is_all_written_ends_the_writing_and_the_connection(
    serve: Serve,
):
    refused = b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 9\r\n\r\ntoo large"
    finished = asyncio.Event()

    async def refuses_large_requests_unread(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        if counted.connections > 1:
            await answers(reader, writer, server)
            return
        await reader.readuntil(b"\r\n\r\n")
        writer.write(refused)  # the body left unread: the client's writing fills its buffers and pauses
        await finished.wait()
        writer.close()

    counted = Counted(refuses_large_requests_unread)
    url = await serve(counted)
    engine = client()
    connection = await engine.post(url, "/v1/completions", LARGE)
    status, body = connection.status, await BackendReply(connection).body()
    again = await BackendReply(await engine.post(url, "/v1/completions", b"{}")).body()
    finished.set()
    engine.close()

    assert (status, body, connection.open, again, counted.connections) == (413, b"too large", False, b"{}", 2)
