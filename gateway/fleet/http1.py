"""The HTTP/1.1 client of the turn path: each call to vLLM on a kept-alive connection to its server, and a
reply's body handed over as what each network read brought.

Not aiohttp here, where every streamed token passes: vLLM writes each token as its own HTTP chunk, and
aiohttp's stream reader runs several Python methods per chunk (begin, feed, end, then a read of each).
httptools' parser (C, the one uvicorn serves with) strips the chunk framing and appends each chunk's bytes to
a list with no Python frame between them: the relay pays per network read, not per token. The fleet's few
other calls (health checks, pause, weights) stay on aiohttp (`engine.py`). Each server's connections, kept
alive between calls, are its `Pool` (`connections.py`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.fleet.connections import Pool, Pools

_HIGH_WATER = 1 << 18
"""Bytes of a reply held unread before the server's socket stops being read (an agent reading slower than
the engine writes): the engine's own send buffer then fills and vLLM waits, rather than the gateway's memory
growing."""
_PIECE = 1 << 20
"""Bytes of a request's body written at a time when it is larger: the transport is handed the next piece only
while it has room (`Connection.pause_writing`), so a large body is paced by the server's reading and is not
copied whole into the transport's buffer. A body of one piece (nearly every call's) is written with its head
at once, as the kernel's socket buffer mostly takes it whole."""
_SILENT = "nothing arrived in {:g} s"
"""A read timeout's message when nothing of the reply came."""
_UNREAD = "the server read no more of the request in {:g} s"
"""A read timeout's message when the server left a request being written unread."""


class ConnectTimeout(Exception):
    """The server did not accept a connection in time: busy, not gone."""


class ConnectFailed(Exception):
    """The connection was refused or the server is unreachable."""


class Disconnected(Exception):
    """The connection closed before the reply began: an idle one the server had closed, or a server that
    went away with the request."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry
        """Sending the request again cannot run it twice: it was never written, or it went on a kept-alive
        connection, which the server may close as it arrives without having read it. A request sent on a new
        connection reached a server that was there to read it."""


class ReplyTimeout(TimeoutError):
    """Nothing arrived from the server for the read timeout, nor did it read more of a request being sent."""


class BrokenReply(Exception):
    """The reply broke off, or was not HTTP."""


class State(enum.Enum):
    """Where a connection is in its life (`Life`). Only IDLE connections are among their server's idle ones,
    and only `Connection._go_idle` makes one IDLE: reading its socket, nothing held, nothing of its last
    reply left, nothing of its last request unwritten."""

    NEW = "new"
    """Connected; nothing asked yet."""
    AWAITING_HEAD = "awaiting head"
    """A request sent, or being written (a body of more than one piece, as the server reads it), its reply's
    final head not yet arrived (interim 1xx replies are skipped)."""
    READING_BODY = "reading body"
    ENDED = "ended"
    """The reply has all arrived; its caller has not let go of it yet."""
    DRAINING = "draining"
    """Let go before the reply's end arrived (a stream's framing after its [DONE]): idle once it does."""
    IDLE = "idle"
    CLOSED = "closed"
    """Closed by either side, or going to be: never used again."""


_MOVES = {
    State.NEW: (State.AWAITING_HEAD, State.CLOSED),
    State.AWAITING_HEAD: (State.READING_BODY, State.CLOSED),
    State.READING_BODY: (State.ENDED, State.DRAINING, State.CLOSED),
    State.ENDED: (State.IDLE, State.CLOSED),
    State.DRAINING: (State.IDLE, State.CLOSED),
    State.IDLE: (State.AWAITING_HEAD, State.CLOSED),
    State.CLOSED: (State.CLOSED,),
}
"""Where a connection may go from each state. Any state may close, a closed one again (both sides close it,
in either order). An ended reply is never read again: what follows it in the read that ended it is past its
end (`Connection.on_message_begin`)."""

_REPLYING = (State.AWAITING_HEAD, State.READING_BODY, State.DRAINING)
"""A reply is on its way: the connection closing now breaks it."""


class Life:
    """A connection's state, which `move` alone changes, refusing a move `_MOVES` does not list."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.NEW

    def move(self, to: State) -> None:
        assert to in _MOVES[self.state], f"{self.state.value} to {to.value}"
        self.state = to


class Connection(asyncio.Protocol):
    """One connection to a server, one exchange at a time (`State`). `read` hands over the body bytes that
    have arrived since the last read; `release` gives the connection back once its reply has ended."""

    def __init__(self, pool: Pool[Connection], read_timeout: float, keepalive: float) -> None:
        self._pool = pool
        """Its server's connections, whose idle ones it joins when an exchange ends cleanly."""
        self._read_timeout = read_timeout
        self._keepalive = keepalive
        self._life = Life()
        self._transport: asyncio.Transport | None = None
        self._pieces: list[bytes] = []
        self.on_body = self._pieces.append
        """httptools' body callback: a builtin method, so a chunk costs no Python call."""
        self._parser: httptools.HttpResponseParser | None = None
        """Set while a reply is expected or held: a read with none is a server talking out of turn."""
        self._waiter: asyncio.Future[None] | None = None
        self._buffered = 0
        self._reading_paused = False
        """Reading stopped (more than the high-water mark held): orthogonal to the state, except IDLE."""
        self._writing_paused = False
        """The transport holds more than its own high-water mark unsent (`pause_writing`)."""
        self._sent_whole = False
        """The last request was written whole: a connection left with part of one unsent is never reused."""
        self._framed = False
        self._keep_alive = False
        self._draining: asyncio.TimerHandle | None = None
        self._error: Exception | None = None
        self._ended_at = 0.0
        self._reused = False
        self.status = 0
        """The reply's status; 0 until its head has arrived (an interim 1xx reply's is never kept)."""
        self.idle_since = 0.0
        """When its last reply ended: the server's keep-alive time counts from then."""

    # -- the protocol's events ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is one, not by inheritance

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # nothing was asked: a server talking out of turn is not to be trusted
            self.close()
            return
        # Counted before the parser takes it: a reply that ends in this read and goes idle (`_go_idle`)
        # leaves its count at 0, so an idle connection is never left with its reading stopped.
        self._buffered += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BrokenReply("the server switched protocols (101), which no call asks for"))
            self.close()
            return
        except httptools.HttpParserError as exc:
            if self._life.state in _REPLYING:
                self._fail(BrokenReply(f"not an HTTP reply: {exc}"))
            # Past a reply's end (`on_message_begin`), its call keeps the reply; the connection, whose
            # server wrote what no call asked for, is closed.
            self.close()
            return
        if self._buffered > _HIGH_WATER and not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()
        self._wake()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake()  # a request being written goes on (`_send`)

    def connection_lost(self, exc: Exception | None) -> None:
        was = self._life.state
        self._life.move(State.CLOSED)
        self._parser = None
        self._cancel_draining()
        self._pool.drop(self)
        if was not in _REPLYING:
            return
        why = f": {exc}" if exc is not None else ""
        if was is State.AWAITING_HEAD:
            self._fail(Disconnected(f"connection closed before the reply{why}", retry=self._reused))
        elif self._framed or exc is not None:
            self._fail(BrokenReply(f"connection closed mid-reply{why}"))
        else:  # a body that runs to the close of the connection: it has ended
            self._wake()

    # -- httptools' callbacks -------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._life.state is not State.AWAITING_HEAD:  # bytes past the reply's end, in the read ending it
            raise BrokenReply("bytes past the reply's end")  # stops the parser: none of them is taken

    def on_header(self, name: bytes, _value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if status >= 200:  # not an interim reply (103 Early Hints, 100 Continue): the final one follows
            self.status = status
            self._life.move(State.READING_BODY)

    def on_message_complete(self) -> None:
        assert self._parser is not None
        life = self._life
        if life.state is State.AWAITING_HEAD:  # an interim reply's end: the parser goes on to the final one
            self._framed = False
            return
        self._ended_at = time.monotonic()
        self._keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once the message is over
        if life.state is State.DRAINING:
            self._cancel_draining()
            self._go_idle()
        else:
            life.move(State.ENDED)
        self._wake()

    # -- one exchange ---------------------------------------------------------------------------------------

    async def exchange(self, request: bytes, body: bytes) -> int:
        """Send a request; its reply's status, once its head has arrived."""
        if not self.open:  # closed by the server between its connect (or its last reply) and now
            raise Disconnected("connection closed before the request", retry=True)
        transport = self._transport
        assert transport is not None and self._life.state in (State.NEW, State.IDLE)
        self._parser = httptools.HttpResponseParser(self)
        self._framed = self._keep_alive = False
        self._error = None
        self.status = 0
        self._buffered = 0
        self._life.move(State.AWAITING_HEAD)
        if len(body) <= _PIECE and not self._writing_paused:
            transport.writelines((request, body))
            self._sent_whole = True
        else:
            await self._send(request, body)
        while not self.status:
            await self._wait()
        return self.status

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read, once some have; b"" at the reply's end."""
        while not self._pieces:
            # Its end read, or the close that ends a body without framing.
            state = self._life.state
            if state is State.ENDED or (state is State.CLOSED and self._error is None):
                return b""
            await self._wait()
        pieces = self._pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._resume()
        return data

    async def body(self) -> bytes:
        """The whole body."""
        parts = []
        while data := await self.read():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """The caller is done: back to the idle connections if the reply has ended; dropped otherwise, which
        tells vLLM to abort the request."""
        if self._life.state is State.ENDED and self._error is None:
            self._go_idle()
        else:
            self.close()

    def drain(self) -> None:
        """The caller has all it wants of a reply whose last bytes (the chunked body's end) may still be on
        their way: the connection goes back to the idle ones when they arrive, and is dropped if they do not
        within the keep-alive time."""
        if self._life.state is not State.READING_BODY or self._error is not None:
            self.release()
            return
        self._life.move(State.DRAINING)
        self._pieces.clear()
        self._resume()
        loop = asyncio.get_running_loop()
        self._draining = loop.call_later(self._keepalive, self.close)

    @property
    def open(self) -> bool:
        return (
            self._life.state is not State.CLOSED
            and self._transport is not None
            and not self._transport.is_closing()
        )

    def close(self) -> None:
        self._cancel_draining()
        self._parser = None
        if self._life.state in _REPLYING and self._error is None:  # not taken for a body run to the close
            self._fail(BrokenReply("connection closed by the gateway mid-reply"))
        self._life.move(State.CLOSED)
        if self._transport is not None:
            self._transport.close()

    # -- inner workings -------------------------------------------------------------------------------------

    async def _send(self, request: bytes, body: bytes) -> None:
        """Write a request a piece of its body at a time (`_PIECE`), each once the transport has room for it.
        A reply that begins meanwhile (a server refusing the request before reading it all) or the
        connection's close ends the writing; the connection, with part of its request unsent, is not reused.
        """
        self._sent_whole = False
        transport = self._transport
        assert transport is not None
        view = memoryview(body)
        for start in range(0, max(len(body), 1), _PIECE):
            while self._writing_paused and self._writing_on():
                await self._wait(_UNREAD)
            if not self._writing_on():
                return
            if start:
                transport.write(view[start : start + _PIECE])
            else:  # the head with the first piece, in one write
                transport.writelines((request, view[:_PIECE]))
        self._sent_whole = True

    def _writing_on(self) -> bool:
        """The request's writing goes on: the connection is open and no reply has begun."""
        return not self.status and self.open

    async def _wait(self, stalled: str = _SILENT) -> None:
        """Until woken (`_wake`) or failed (`_fail`); `stalled`: the timeout's message, should nothing happen
        for the read timeout."""
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self._read_timeout, self._time_out, waiter, stalled)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _resume(self) -> None:
        """What was held has been taken: the server's socket is read again."""
        self._buffered = 0
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _time_out(self, waiter: asyncio.Future[None], stalled: str) -> None:
        if not waiter.done():
            waiter.set_exception(ReplyTimeout(stalled.format(self._read_timeout)))

    def _fail(self, error: Exception) -> None:
        self._error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _cancel_draining(self) -> None:
        if self._draining is not None:
            self._draining.cancel()
            self._draining = None

    def _go_idle(self) -> None:
        """The only way to IDLE: the reply over, its request written whole, its connection reading again with
        nothing held; or closed."""
        life, pool = self._life, self._pool
        if life.state is State.CLOSED or not self._keep_alive or not self._sent_whole or pool.retired:
            self.close()
            return
        self._parser = None
        self._pieces.clear()  # what the caller left unread is not the next call's
        self._resume()
        self.idle_since = self._ended_at
        self._reused = True
        life.move(State.IDLE)
        pool.keep(self)


class _Target:
    """Where a server's URL points, read once: what a connection to it needs, what each request's head
    starts and ends with."""

    def __init__(self, base: str) -> None:
        url = urlsplit(base)
        self.secure = url.scheme == "https"
        self.host = url.hostname or ""
        self.port = url.port or (443 if self.secure else 80)
        self.prefix = url.path.rstrip("/").encode()
        """A path the server is served under, before each call's own."""
        self.host_header = url.netloc.rpartition("@")[2].encode()


class Http1Client:
    """The turn path's calls, each on a connection of its server's pool (`pools`): an idle one reused, else a
    new one. A stream let go at its [DONE] keeps its connection the moment its end takes to arrive."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        keepalive: float,
        max_connections: int,
        authorization: str | None,
    ) -> None:
        """`keepalive`: idle connections older than this are not reused (closed when next come upon), shorter
        than the server keeps them. `max_connections`: the slots of each server's pool, which `EngineClient`
        takes one of for each call."""
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._keepalive = keepalive
        self._auth = b"authorization: %s\r\n" % authorization.encode() if authorization else b""
        self._targets: dict[str, _Target] = {}
        self.pools: Pools[Connection] = Pools(max_connections, keepalive)

    async def post(self, base: str, path: str, body: bytes, *, fresh: bool = False) -> Connection:
        """POST JSON to `path` on the server at `base`; the connection once the reply's head has arrived.
        `fresh`: on a new connection, not an idle one.

        Raises ConnectTimeout, ConnectFailed, Disconnected (the connection closed before the reply began),
        ReplyTimeout or BrokenReply."""
        target = self._targets.get(base) or self._targets.setdefault(base, _Target(base))
        pool = self.pools.of(base)
        connection = (None if fresh else pool.reuse()) or await self._connect(base, target, pool)
        head = b"POST %s%s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        request = head % (target.prefix, path.encode(), target.host_header, len(body)) + self._auth + b"\r\n"
        try:
            await connection.exchange(request, body)
        except BaseException:
            connection.close()
            raise
        return connection

    async def _connect(self, base: str, target: _Target, pool: Pool[Connection]) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                transport, connection = await loop.create_connection(
                    lambda: Connection(pool, self._read_timeout, self._keepalive),
                    target.host,
                    target.port,
                    ssl=target.secure or None,
                )
        except TimeoutError as exc:
            raise ConnectTimeout(f"no connection within {self._connect_timeout:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {base}: {exc!r}") from exc
        connection.connection_made(transport)  # uvloop may make the call only after returning
        return connection

    def forget(self, base: str) -> None:
        """The server at `base` left: its idle connections are closed, and the others when their calls end."""
        self._targets.pop(base, None)
        self.pools.forget(base)

    def close(self) -> None:
        self.pools.close()
