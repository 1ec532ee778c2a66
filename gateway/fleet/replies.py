"""What the servers answer, as the turn path reads it: a reply streamed or whole, the server that gave it, and
the failures the gateway maps to HTTP errors (`gateway.errors`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from gateway.fleet.http1 import BrokenReply, Connection, ReplyTimeout


class BackendStreamError(Exception):
    """The backend's reply broke off while it was being read."""


class BackendFailure(Exception):
    """No answer from the backends: `kind` is timeout, unreachable, busy or failed (`gateway.errors` maps it
    to HTTP)."""

    def __init__(self, kind: str, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.url = url
        """The server that failed, when one was reached."""


class BackendReply:
    def __init__(self, connection: Connection, on_done: Callable[[], None] = lambda: None) -> None:
        self._connection = connection
        self.status = connection.status
        self._on_done: Callable[[], None] | None = on_done

    async def body(self) -> bytes:
        try:
            return await self._connection.body()
        except (ReplyTimeout, BrokenReply) as exc:
            raise BackendStreamError(f"backend reply broke off: {exc}") from exc
        finally:
            self.close()

    async def read(self) -> bytes:
        """What has arrived of a streamed reply since the last read, once something has; b"" at its end. A
        method, not a generator: a stream's every read passes through here."""
        try:
            return await self._connection.read()
        except (ReplyTimeout, BrokenReply) as exc:
            raise BackendStreamError(f"backend stream broke off: {exc}") from exc

    def ended(self) -> None:
        """The stream said its last ([DONE]): the connection serves another call once the reply's framing
        ends, which may come in a later read."""
        self._let_go(Connection.drain)

    def close(self) -> None:
        """Drop the connection if the reply was not read to the end (vLLM then aborts the request)."""
        self._let_go(Connection.release)

    def _let_go(self, how: Callable[[Connection], None]) -> None:
        """The connection is let go of once, and the call no longer loads its server."""
        done, self._on_done = self._on_done, None
        if done is not None:
            how(self._connection)
            done()


class Routed(NamedTuple):
    url: str
    reply: BackendReply
    repinned_from: str | None
    """The server the rollout was moved off for this call (failed, drained away or removed), if any."""
