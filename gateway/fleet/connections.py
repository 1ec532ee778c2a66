"""Each server's connections on the turn path, in one place: how many calls hold one at once
(`--max-connections`; the others wait in the engine client's queue), and the idle ones kept alive between
calls. `gateway.fleet.engine` takes a slot of a server's `Pool` for each call and gives it back when the call
lets go of its reply; `gateway.fleet.http1` reuses the pool's idle connections and puts back the ones whose
reply ended cleanly. The pool knows a connection only as `Reusable`: it opens none and reads none.
"""

from __future__ import annotations

import asyncio
import time
from typing import Generic, Protocol, TypeVar


class Reusable(Protocol):
    """What a pool asks of a connection it keeps idle."""

    idle_since: float
    """When its last reply ended: the keep-alive time counts from then."""

    @property
    def open(self) -> bool: ...

    def close(self) -> None: ...


C = TypeVar("C", bound=Reusable)


class Pool(Generic[C]):
    """One server's connections: the slots its calls hold (a connection each), and the idle connections, the
    most recently used reused first (the least likely to have been closed by the server). A slot bounds the
    calls, not the connections: a stream let go at its [DONE] gives its slot back while its connection waits
    for the reply's end before going idle."""

    def __init__(self, limit: int, keepalive: float) -> None:
        self._slots = asyncio.Semaphore(limit)
        self._keepalive = keepalive
        self._idle: list[C] = []
        """The most recently used last."""
        self.retired = False
        """The server left the fleet: a connection of its still out on a call is closed when the call ends."""

    @property
    def full(self) -> bool:
        """Every slot is held: a call waits for one (in the engine client's queue)."""
        return self._slots.locked()

    async def take(self) -> None:
        """A slot for one call: at once when one is free, else when a call gives one back."""
        await self._slots.acquire()

    def give_back(self) -> None:
        self._slots.release()

    def reuse(self) -> C | None:
        """The most recently used idle connection that is still open and younger than the keep-alive time
        (shorter than the server keeps them); the others met on the way are closed."""
        oldest = time.monotonic() - self._keepalive
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.idle_since >= oldest and connection.open:
                return connection
            connection.close()
        return None

    def keep(self, connection: C) -> None:
        """`connection` is idle: the next call may reuse it (not asked of a retired pool)."""
        self._idle.append(connection)

    def drop(self, connection: C) -> None:
        """`connection` closed: it is not reused."""
        if connection in self._idle:
            self._idle.remove(connection)

    def retire(self) -> None:
        """The server left: its idle connections are closed, and the others when their calls end."""
        self.retired = True
        self.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class Pools(Generic[C]):
    """The pool of each server, by its base URL, each of `limit` slots."""

    def __init__(self, limit: int, keepalive: float) -> None:
        self.limit = limit
        """Calls each server holds a connection for at once; more wait in the queue."""
        self._keepalive = keepalive
        """Idle connections older than this are not reused: shorter than the servers keep them."""
        self._pools: dict[str, Pool[C]] = {}

    def of(self, url: str) -> Pool[C]:
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = Pool(self.limit, self._keepalive)
        return pool

    def forget(self, url: str) -> None:
        """The server at `url` left (`Pool.retire`); one of that URL added later has a pool of its own."""
        pool = self._pools.pop(url, None)
        if pool is not None:
            pool.retire()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
