"""The gateway's client of the vLLM servers: each call sent to its rollout's server, routed through the fleet
(`gateway.fleet.fleet`), over the turn path's own HTTP/1.1 client (`http1.py`); health checks and control
calls go through one pooled aiohttp session. `Engine` is what the turn, control and admin paths ask of it (the
in-process tests script it, on the real fleet).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

import aiohttp

from gateway.fleet import health
from gateway.fleet.connections import Pool
from gateway.fleet.fleet import Fleet
from gateway.fleet.http1 import (
    BrokenReply,
    ConnectFailed,
    Connection,
    ConnectTimeout,
    Disconnected,
    Http1Client,
)
from gateway.fleet.leaders import Ahead
from gateway.fleet.replies import BackendFailure, BackendReply, Routed
from gateway.fleet.routing import usable
from gateway.fleet.servers import Server

log = logging.getLogger(__name__)

_CONTROL_CONNECTIONS = 8
"""Connections of the aiohttp session to each server beyond the turn path's (`--max-connections`): health
checks and the fleet's control calls (pause, weights) never wait behind agents' reads through it (/v1/models,
/detokenize)."""


_KEEPALIVE = 4.0
"""Idle connections are not reused past this, shorter than vLLM's uvicorn keeps them (5 s), so that few stale
ones are."""
_COPY_SHARE = 0.1
"""The share of the backend timeout a group's copy sent ahead may take (`gateway.fleet.leaders`): it asks a
prefill and one token, a small part of what a call may take; past it the calls behind it go on, each with
what is left of its own deadline, and find in the cache the part of the prompt the copy computed."""
_UNWRITTEN = "Can not write request body"
"""How aiohttp words a request whose body could not be sent: the server cannot have acted on it."""


class ServerLost(Exception):
    """A server dropped a call and then refused a new connection: it went away, maybe with the call."""


class Engine(Protocol):
    """What the turn path and the control and admin paths ask of the servers: `EngineClient`, or a scripted
    stand-in in tests."""

    queued: int
    """Calls waiting for a connection or for a prompt computed ahead of them (the queue's depth)."""

    async def route(self, rollout_id: str, model: str | None) -> tuple[Server, str | None]:
        """The rollout's server, pinned to it, and the server it left if it moved."""
        ...

    async def send(
        self, rollout_id: str, path: str, body: bytes, model: str | None = None, ahead: Ahead | None = None
    ) -> Routed:
        """POST to the rollout's server."""
        ...

    async def exact_capable(self, server: Server) -> bool:
        """Whether `server` serves vLLM's token-in/token-out endpoints (exact mode)."""
        ...

    async def probe_scale_out(self, url: str) -> bool | None:
        """Ask a server whether exact mode works there; None if it cannot be reached."""
        ...

    async def call_all(
        self,
        path: str,
        *,
        params: dict[str, str] | None = None,
        json: object = None,
        done: Callable[[Server], None] = lambda _server: None,
    ) -> None:
        """POST to every healthy server (pause, resume, weights)."""
        ...

    async def call_one(self, url: str, body: object, params: dict[str, str] | None = None) -> str | None:
        """POST to one server (`url`: its base URL and path); what went wrong, or None."""
        ...

    async def post_any(self, path: str, body: object, model: str | None) -> tuple[int, bytes]:
        """POST to any healthy server that serves `model`, without routing a rollout."""
        ...

    async def get(self, path: str) -> tuple[int, bytes]: ...

    async def check(self, server: Server) -> health.Found:
        """One health check of `server`."""
        ...

    async def close(self) -> None: ...


def turn_client(
    *, timeout: float, connect_timeout: float, max_connections: int, api_key: str | None
) -> Http1Client:
    """The turn path's HTTP/1.1 client, with the gateway's own credentials (vLLM's --api-key); an agent's are
    never forwarded. `max_connections`: the calls each server takes at once (`--max-connections`)."""
    return Http1Client(
        connect_timeout=connect_timeout,
        read_timeout=timeout,
        keepalive=_KEEPALIVE,
        max_connections=max_connections,
        authorization=_bearer(api_key),
    )


def _bearer(api_key: str | None) -> str | None:
    return f"Bearer {api_key}" if api_key else None


class EngineClient:
    def __init__(
        self,
        fleet: Fleet,
        calls: Http1Client,
        *,
        timeout: float,
        connect_timeout: float,
        max_queued: int,
        api_key: str | None = None,
        eject_after: int = 2,
        waited: Callable[[float], None] = lambda _seconds: None,
        ejected: Callable[[Server], None] = lambda _server: None,
        revived: Callable[[health.Found], None] = lambda _found: None,
    ) -> None:
        """`calls`: the turn path's client (`turn_client`), whose pools bound the calls each server takes at
        once (the fleet closes its connections to a server that leaves). `waited`: told the seconds each call
        waited for a connection (the metrics' queue stage). `ejected`: told when a call finds a server
        unreachable (`gateway.replicas.publish` tells every process). `revived`: told when an ejected server
        passed a check made for a call that no server took (`revive`)."""
        self.fleet = fleet
        self.max_queued = max_queued
        self.queued = 0
        """Calls waiting for a connection to their server or for the prompt their group's first call computes
        ahead of them, all servers together."""
        self.timeout = timeout
        """Seconds a call may wait for its reply, a prompt computed ahead of it included."""
        self.waited, self.ejected, self.revived = waited, ejected, revived
        self.eject_after = eject_after
        """Failed health checks in a row before a server takes no more calls."""
        self.connect_timeout = connect_timeout
        self._probes: dict[str, asyncio.Future[bool]] = {}
        """The checks `revive` has in flight, by server: one each, whatever the calls waiting on it."""
        self._calls = calls
        authorization = _bearer(api_key)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                limit_per_host=calls.pools.limit + _CONTROL_CONNECTIONS,
                keepalive_timeout=_KEEPALIVE,
            ),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout),
            headers={"authorization": authorization} if authorization else None,
        )

    # -- calls ----------------------------------------------------------------------------------------------

    async def route(self, rollout_id: str, model: str | None) -> tuple[Server, str | None]:
        """The rollout's server (`Fleet.route`). When no server takes it, the ejected ones are checked at
        once (`revive`) before the call is refused."""
        try:
            return await self.fleet.route(rollout_id, model)
        except BackendFailure:
            if not await self.revive():
                raise
        return await self.fleet.route(rollout_id, model)

    async def revive(self) -> bool:
        """Check every ejected server now, not at the next health check: a call that no server takes would
        be refused, and a server that came back would wait up to --health-interval for its check (a load
        balancer's panic mode). Those that pass are admitted, for every process (`revived`); whether one did.
        One check runs at a time on each server: a burst of calls waits on the same one."""
        probes = [self._probe(s) for s in self.fleet.servers.values() if not s.healthy]
        return any(await asyncio.gather(*probes))

    async def _probe(self, server: Server) -> bool:
        probe = self._probes.get(server.url)
        if probe is None:
            probe = self._probes[server.url] = asyncio.ensure_future(self._readmit(server))
            probe.add_done_callback(lambda _: self._probes.pop(server.url, None))
        return await asyncio.shield(probe)  # a call that leaves does not end the check the others wait on

    async def _readmit(self, server: Server) -> bool:
        found = await self.check(server)
        if not found.healthy:
            return False
        server.healthy = True
        server.models, server.prefix_cache_hit_rate = found.models, found.prefix_cache_hit_rate
        server.weight_spans = found.weight_spans
        if found.weights is not None:
            server.reloads, server.weight_version = found.weights.reloads, found.weights.version
        server.adapter_errors = found.adapter_errors
        self.revived(found)
        return True

    async def send(
        self, rollout_id: str, path: str, body: bytes, model: str | None = None, ahead: Ahead | None = None
    ) -> Routed:
        """POST to the rollout's server; a server that refuses the connection is ejected and the rollout moves
        to another one (the request never reached it). A server slow to accept one is busy, not dead: it
        stays, and the call is refused for its client to retry.

        Raises BackendFailure: unreachable when no server accepts a connection, busy, queue_full, timeout,
        or failed. `ahead`: the call is one of its group's first, whose prompt is computed once for it and its
        siblings (`gateway.fleet.leaders`): the wait for that computation and the call's reply share the one
        backend timeout.
        """
        moved_from: str | None = None
        last_error: Exception | None = None
        deadline = time.monotonic() + self.timeout
        for _ in range(len(self.fleet.servers)):
            server, left = await self.route(rollout_id, model)
            moved_from = moved_from or left
            if ahead is not None:
                compute = partial(self._compute, server, ahead)
                await self.fleet.leaders.first(server.url, ahead, compute, partial(self._queue, server))
            pool = await self._connection(server)
            started = time.monotonic()
            server.in_flight += 1
            server.requests += 1
            try:
                if ahead is None:  # the reply's own read timeout is the call's deadline
                    connection = await self._post(server.url, path, body)
                else:
                    async with asyncio.timeout(deadline - time.monotonic()):
                        connection = await self._post(server.url, path, body)
            except ConnectTimeout as exc:  # not a refusal: the server is busy
                self._failed(server, pool)
                raise BackendFailure(
                    "busy",
                    f"backend {server.url} did not accept a connection within {self.connect_timeout:g} s: "
                    "it is busy, not gone; retry",
                    server.url,
                ) from exc
            except ConnectFailed as exc:
                self._failed(server, pool)
                self._eject(server, f"connection failed: {exc}")
                last_error, moved_from = exc, moved_from or server.url
                continue
            except ServerLost as exc:
                self._failed(server, pool)
                self._eject(server, f"went away: {exc.__cause__}")
                raise BackendFailure("failed", f"backend {server.url} went away: {exc}", server.url) from exc
            except TimeoutError as exc:  # the reply's read timeout (ReplyTimeout), or the call's deadline
                self._failed(server, pool)
                raise BackendFailure("timeout", f"backend {server.url} timed out", server.url) from exc
            except (Disconnected, BrokenReply) as exc:
                self._failed(server, pool)
                raise BackendFailure("failed", f"backend {server.url} failed: {exc}", server.url) from exc
            except BaseException:  # cancelled (the agent left), or unforeseen: the connection is given back
                _release_connection(server, pool)
                raise
            server.took(time.monotonic() - started)
            if connection.status >= 500:
                server.errors += 1
            return Routed(
                server.url, BackendReply(connection, partial(_release_connection, server, pool)), moved_from
            )
        message = f"no backend reachable ({', '.join(self.fleet.servers)}): {last_error!r}"
        raise BackendFailure("unreachable", message) from last_error

    async def _compute(self, server: Server, ahead: Ahead) -> None:
        """Have the server compute the prompt of `ahead` (its copy's reply, read to the end), within the
        copy's share of the timeout: past it the copy is dropped (vLLM aborts it)."""
        async with asyncio.timeout(self.timeout * _COPY_SHARE):
            pool = await self._connection(server)
            server.in_flight += 1
            server.requests += 1
            try:
                connection = await self._post(server.url, ahead.path, ahead.copy)
            except BaseException:
                _release_connection(server, pool)
                raise
            await BackendReply(connection, partial(_release_connection, server, pool)).body()

    async def _connection(self, server: Server) -> Pool[Connection]:
        """Take a slot of the server's pool, waiting in the queue while all are held; the pool, to give it
        back to (that of the server's URL when the call began, even if the server leaves meanwhile)."""
        pool = self._calls.pools.of(server.url)
        if pool.full:
            await self._queue(server, pool.take)
        else:
            await pool.take()  # free: returns at once
        return pool

    async def _queue(self, server: Server, wait: Callable[[], Awaitable[object]]) -> None:
        """Wait in the queue (`wait`: for a connection, or for the prompt computed ahead). Past `max_queued`
        waiting calls the call is refused: an overloaded fleet answers 503 with retry-after, which clients
        retry, rather than holding calls without bound."""
        if self.queued >= self.max_queued:
            raise BackendFailure(
                "queue_full",
                f"{self.queued} calls already wait for a connection to a backend (--max-queued "
                f"{self.max_queued}); retry",
                server.url,
            )
        self.queued += 1
        started = time.monotonic()
        try:
            await wait()
        finally:
            self.queued -= 1
            self.waited(time.monotonic() - started)

    def _failed(self, server: Server, pool: Pool[Connection]) -> None:
        _release_connection(server, pool)
        server.errors += 1

    def _eject(self, server: Server, why: str) -> None:
        if server.healthy:
            log.warning("backend %s ejected: %s", server.url, why)
            server.healthy = False
            self.ejected(server)

    async def _post(self, base: str, path: str, body: bytes) -> Connection:
        """POST, once more if the server closed a reused connection before answering. The usual cause is a
        pooled idle connection the server closed just as it was reused (the request never got through); one
        closed on a new connection was read by a server that may have begun the work, which is not run twice.
        The second attempt is made on a new connection, which a server that really went away refuses: it may
        have died with the call at work, so the call fails (ServerLost) rather than moving to another server,
        whether the kill reached the client as a close or a reset."""
        try:
            return await self._calls.post(base, path, body)
        except Disconnected as exc:
            if not exc.retry:
                raise
        try:
            return await self._calls.post(base, path, body, fresh=True)
        except ConnectFailed as exc:
            raise ServerLost(f"{base} closed a call's connection, then refused a new one") from exc

    async def call_one(self, url: str, body: object, params: dict[str, str] | None = None) -> str | None:
        """POST to one server; what went wrong, or None. Sent once more if the server closed the connection
        before answering or before the body was written (an idle connection it closed as it was reused)."""
        try:
            return await self._call(url, body, params)
        except aiohttp.ServerDisconnectedError:
            pass
        except aiohttp.ClientOSError as exc:
            if not str(exc.strerror).startswith(_UNWRITTEN):
                return f"{url}: {exc!r}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"{url}: {exc!r}"
        try:
            return await self._call(url, body, params)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"{url}: {exc!r}"

    async def _call(self, url: str, body: object, params: dict[str, str] | None) -> str | None:
        async with self._session.post(url, params=params, json=body) as response:
            if response.status != 200:
                return f"{url}: HTTP {response.status} {(await response.text())[:200]}"
        return None

    async def call_all(
        self,
        path: str,
        *,
        params: dict[str, str] | None = None,
        json: object = None,
        done: Callable[[Server], None] = lambda _server: None,
    ) -> None:
        """POST to every healthy backend (pause, resume, weights), `done` with each that took it; 502 names
        the ones that failed."""
        failures = []
        for server in list(self.fleet.servers.values()):
            if not server.healthy:
                continue
            failure = await self.call_one(server.url + path, json, params)
            if failure is None:
                done(server)
            else:
                failures.append(failure)
        if failures:
            raise BackendFailure("failed", f"{path} failed on " + "; ".join(failures))

    async def post_any(self, path: str, body: object, model: str | None) -> tuple[int, bytes]:
        """POST to any healthy server that serves `model`, without routing a rollout (reads such as
        `/detokenize`); the first server that answers does. A LoRA policy's reads go to its base's servers:
        an adapter shares its base's tokenizer."""
        last_error: Exception | None = None
        model = self.fleet.adapters.bases.get(model or "", model)
        for server in [s for s in self.fleet.servers.values() if usable(s, model)]:
            try:
                async with self._session.post(server.url + path, json=body) as response:
                    return response.status, await response.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                last_error = exc
        raise BackendFailure("unreachable", f"no backend serving {model!r} reachable: {last_error!r}")

    async def get(self, path: str) -> tuple[int, bytes]:
        last_error: Exception | None = None
        for server in sorted(self.fleet.servers.values(), key=lambda s: not s.healthy):
            try:
                async with self._session.get(server.url + path) as response:
                    return response.status, await response.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                last_error = exc
        raise BackendFailure("unreachable", f"no backend reachable: {last_error!r}") from last_error

    # -- what the servers can do ----------------------------------------------------------------------------

    async def check(self, server: Server) -> health.Found:
        """One health check of `server` (`gateway.fleet.health`): what the run state should say of it."""
        return await health.check(
            self._session,
            server,
            self.fleet.weights,
            self.fleet.first_version,
            self.fleet.adapters,
            self.eject_after,
            self.call_one,
            last=self.fleet.last_of_a_model(server),
            connect_timeout=self.connect_timeout,
        )

    async def probe_scale_out(self, url: str) -> bool | None:
        """Ask a backend for a render: 200 means exact mode works there; None if it cannot be reached."""
        body = {"messages": [{"role": "user", "content": "ping"}]}
        try:
            async with self._session.post(url + "/v1/chat/completions/render", json=body) as response:
                capable = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return None
        if url in self.fleet.servers:
            self.fleet.servers[url].scale_out = capable
        return capable

    async def exact_capable(self, server: Server) -> bool:
        """Whether `server` serves exact mode: as its start-up probe found, else asked now."""
        known = server.scale_out
        if known is None:
            known = await self.probe_scale_out(server.url)
            if known is False:
                log.warning(
                    "backend %s lacks --enable-scale-out: exact-mode turns run in pass-through", server.url
                )
        return bool(known)

    async def close(self) -> None:
        self._calls.close()
        await self._session.close()


def _release_connection(server: Server, pool: Pool[Connection]) -> None:
    """The call gave its connection back."""
    server.in_flight -= 1
    pool.give_back()
