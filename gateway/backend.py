"""The vLLM servers behind the gateway: one pooled aiohttp session, the fleet's state (`gateway.fleet`), and
each rollout pinned to one server, in the store, so that every replica routes it alike.

aiohttp rather than httpx on this path: it costs a fraction of httpx's per-request overhead (measured in
bench/gateway_overhead.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from functools import partial
from typing import Any, NamedTuple

import aiohttp

from gateway.fleet.routing import choose, usable
from gateway.fleet.servers import Server
from gateway.store.pins import Pin

log = logging.getLogger(__name__)


_UNWRITTEN = "Can not write request body"
"""How aiohttp words a request whose body could not be sent: the server cannot have acted on it."""


class BackendStreamError(Exception):
    """The backend's reply broke off while it was being read."""


class BackendFailure(Exception):
    """No answer from the backends: `kind` is timeout, unreachable or failed (`gateway.errors` maps it to
    HTTP)."""

    def __init__(self, kind: str, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.url = url
        """The server that failed, when one was reached."""


class BackendReply:
    def __init__(self, response: aiohttp.ClientResponse, on_done: Callable[[], None] = lambda: None) -> None:
        self._response = response
        self.status = response.status
        self._on_done: Callable[[], None] | None = on_done

    async def body(self) -> bytes:
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise BackendStreamError(f"backend reply broke off: {exc!r}") from exc
        finally:
            self._response.release()
            self._done()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise BackendStreamError(f"backend stream broke off: {exc!r}") from exc
        finally:
            self._done()

    def close(self) -> None:
        """Drop the connection if the reply was not read to the end (vLLM then aborts the request)."""
        self._response.close()
        self._done()

    def _done(self) -> None:
        """The call no longer loads its server (counted once)."""
        done, self._on_done = self._on_done, None
        if done is not None:
            done()


class Routed(NamedTuple):
    url: str
    reply: BackendReply
    repinned_from: str | None
    """The server the rollout was moved off for this call (failed, drained away or removed), if any."""


PinStore = Callable[[str, str, Collection[str]], Awaitable[Pin]]
"""(rollout id, candidate server, servers that can keep a rollout) -> its pin: the store's compare-and-set of
pins (`Store.pin`)."""

_PINS_KEPT = 100_000
"""Pins remembered in memory (the store holds them all)."""


class BackendPool:
    def __init__(
        self,
        urls: list[str],
        *,
        timeout: float,
        connect_timeout: float,
        max_connections: int,
        api_key: str | None = None,
        eject_after: int = 2,
    ) -> None:
        if not urls:
            raise ValueError("at least one backend URL is required")
        self.servers: dict[str, Server] = {}
        for url in urls:
            self.add(url, healthy=True)
        self.eject_after = eject_after
        """Failed health checks in a row before a server takes no more calls."""
        self.reloads = 0
        """Weight reloads the fleet has done (`reload_weights`)."""
        self.weight_version: str | None = None
        """The weight version last given to the fleet (`set_weight_version`); None: never set."""
        self.gives_weights: Callable[[], bool] = lambda: True
        """Whether this process gives a returning server the weights it missed. Of several worker processes
        only the leading one does (a server is not reloaded once per process); the others admit it once told
        it has them."""
        self.caught_up: Callable[[Server], None] = lambda _server: None
        """Called when this process has given a server the weights it missed."""
        self.pin_store: PinStore | None = None
        """Set by the app to share pins through the store; without it pins live in this process only."""
        self._pins: OrderedDict[str, tuple[str, bool]] = OrderedDict()
        """Rollout -> (its server, whether this process placed it there: only those count as `pinned`, so
        that the counts of several replicas add up)."""
        self._session = aiohttp.ClientSession(
            # Idle connections are dropped before vLLM's uvicorn drops them (5 s), so that few stale ones are
            # reused.
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout),
            # The gateway's own credentials (vLLM's --api-key); an agent's are never forwarded.
            headers={"authorization": f"Bearer {api_key}"} if api_key else None,
        )

    @property
    def urls(self) -> list[str]:
        return list(self.servers)

    # -- the fleet ------------------------------------------------------------------------------------------

    def add(self, url: str, *, healthy: bool = False) -> Server:
        """A server joins (or, draining, takes new rollouts again). One added at run time takes calls once a
        health check has passed; the configured ones are taken as healthy from the start."""
        url = url.rstrip("/")
        server = self.servers.get(url)
        if server is None:
            server = self.servers[url] = Server(url, healthy=healthy, added_at=time.time())
            log.info("backend %s added", url)
        server.draining = False
        return server

    def drain(self, url: str) -> Server:
        """No new rollouts go to the server; those pinned to it finish there."""
        server = self._known(url)
        server.draining = True
        log.info(
            "backend %s draining: %d rollouts pinned, %d calls in flight",
            url,
            server.pinned,
            server.in_flight,
        )
        return server

    def remove(self, url: str) -> Server:
        """The server leaves: its rollouts move to others on their next call (calls in flight finish)."""
        server = self._known(url)
        if len(self.servers) == 1:
            raise ValueError(f"{url} is the only backend: add another before removing it")
        del self.servers[server.url]
        log.info("backend %s removed", url)
        return server

    def _known(self, url: str) -> Server:
        server = self.servers.get(url.rstrip("/"))
        if server is None:
            raise KeyError(url)
        return server

    # -- routing --------------------------------------------------------------------------------------------

    async def route(self, rollout_id: str, model: str | None) -> tuple[Server, str | None]:
        """The rollout's server: its pin while that server can serve, else a new one (pinned in the store). A
        model no server lists goes where any model goes: the server's own answer (a 404) is the agent's."""
        if model is not None and not any(model in s.models for s in self.servers.values()):
            model = None
        pinned = self._pins.get(rollout_id)
        server = self.servers.get(pinned[0]) if pinned is not None else None
        if server is not None and usable(server, model):
            self._pins.move_to_end(rollout_id)
            return server, None
        candidate = choose(self.servers.values(), rollout_id, model)
        if candidate is None:
            raise BackendFailure("unreachable", _none_for(model, self.servers.values()))
        keep = [s.url for s in self.servers.values() if usable(s, model)]
        if self.pin_store is None:
            url, left, placed = candidate.url, pinned[0] if pinned else None, True
        else:
            # The choice and its count are one step: the candidate holds the rollout while the store's
            # compare-and-set is awaited, so that the rollouts of a group starting together, placed in that
            # window, see it and spread. The hold is given back, and the pin counted, with no await between.
            candidate.pinned += 1
            try:
                url, left, placed = await self.pin_store(rollout_id, candidate.url, keep)
            finally:
                candidate.pinned -= 1
        server = self.servers.get(url, candidate)
        self._remember(rollout_id, server.url, placed)
        return server, left if left != server.url else None

    def _remember(self, rollout_id: str, url: str, placed: bool) -> None:
        known = self._pins.get(rollout_id)
        if known is not None and known[0] == url:  # two calls of one rollout placed it at once: count it once
            if placed and not known[1]:
                self._pins[rollout_id] = (url, True)
                self.servers[url].pinned += 1
            self._pins.move_to_end(rollout_id)
            return
        self.forget(rollout_id)
        self._pins[rollout_id] = (url, placed)
        if placed:
            self.servers[url].pinned += 1
        if len(self._pins) > _PINS_KEPT:
            self.forget(next(iter(self._pins)))

    def forget(self, rollout_id: str) -> None:
        """The rollout is over (or moved): it no longer counts on its server."""
        pin = self._pins.pop(rollout_id, None)
        if pin is not None and pin[1] and pin[0] in self.servers:
            self.servers[pin[0]].pinned -= 1

    async def send(self, rollout_id: str, path: str, body: bytes, model: str | None = None) -> Routed:
        """POST to the rollout's server; a server that refuses the connection is ejected and the rollout moves
        to another one (the request never reached it).

        Raises BackendFailure: unreachable when no server accepts a connection, timeout, or failed.
        """
        moved_from: str | None = None
        last_error: Exception | None = None
        for _ in range(len(self.servers)):
            server, left = await self.route(rollout_id, model)
            moved_from = moved_from or left
            started = time.monotonic()
            server.in_flight += 1
            server.requests += 1
            try:
                response = await self._post(
                    server.url + path, data=body, headers={"content-type": "application/json"}
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                self._failed(server, exc)
                self._eject(server, f"connection failed: {exc!r}")
                last_error, moved_from = exc, moved_from or server.url
                continue
            except TimeoutError as exc:
                self._failed(server, exc)
                raise BackendFailure("timeout", f"backend {server.url} timed out", server.url) from exc
            except aiohttp.ClientError as exc:
                self._failed(server, exc)
                raise BackendFailure("failed", f"backend {server.url} failed: {exc!r}", server.url) from exc
            server.took(time.monotonic() - started)
            if response.status >= 500:
                server.errors += 1
            return Routed(server.url, BackendReply(response, partial(_left, server)), moved_from)
        message = f"no backend reachable ({', '.join(self.servers)}): {last_error!r}"
        raise BackendFailure("unreachable", message) from last_error

    def _failed(self, server: Server, exc: Exception) -> None:
        server.in_flight -= 1
        server.errors += 1

    def _eject(self, server: Server, why: str) -> None:
        if server.healthy:
            log.warning("backend %s ejected: %s", server.url, why)
        server.healthy = False
        server.failed_checks = max(server.failed_checks, self.eject_after)

    async def _post(self, url: str, **kwargs: Any) -> aiohttp.ClientResponse:
        """POST, once more if the server closed the connection before answering or before the body was
        written. The usual cause is a pooled idle connection the server closed just as it was reused (the
        request never got through); a server that really went away fails the second attempt too."""
        try:
            return await self._session.post(url, **kwargs)
        except aiohttp.ServerDisconnectedError:
            return await self._session.post(url, **kwargs)
        except aiohttp.ClientOSError as exc:
            if not str(exc.strerror).startswith(_UNWRITTEN):
                raise
            return await self._session.post(url, **kwargs)

    # -- what the servers can do ----------------------------------------------------------------------------

    async def probe_scale_out(self, url: str) -> bool | None:
        """Ask a backend for a render: 200 means exact mode works there; None if it cannot be reached."""
        body = {"messages": [{"role": "user", "content": "ping"}]}
        try:
            async with self._session.post(url + "/v1/chat/completions/render", json=body) as response:
                capable = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return None
        if url in self.servers:
            self.servers[url].scale_out = capable
        return capable

    async def exact_capable(self, rollout_id: str, model: str | None = None) -> bool:
        server, _ = await self.route(rollout_id, model)
        known = server.scale_out
        if known is None:
            known = await self.probe_scale_out(server.url)
            if known is False:
                log.warning(
                    "backend %s lacks --enable-scale-out: exact-mode turns run in pass-through", server.url
                )
        return bool(known)

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
        for server in list(self.servers.values()):
            if not server.healthy:
                continue
            failure = await self._call(server, path, params=params, json=json)
            if failure is None:
                done(server)
            else:
                failures.append(failure)
        if failures:
            raise BackendFailure("failed", f"{path} failed on " + "; ".join(failures))

    async def _call(
        self, server: Server, path: str, *, params: dict[str, str] | None = None, json: object = None
    ) -> str | None:
        """POST to one server; what went wrong, or None."""
        try:
            response = await self._post(server.url + path, params=params, json=json)
            async with response:
                if response.status != 200:
                    return f"{server.url}: HTTP {response.status} {(await response.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"{server.url}: {exc!r}"
        return None

    # -- weights: every server serving holds the fleet's -----------------------------------------------------

    async def reload_weights(self) -> None:
        """Every healthy server reloads its weights from its model directory."""
        self.reloads += 1
        await self.call_all(_RELOAD, json=_RELOAD_BODY, done=partial(_reloaded, reloads=self.reloads))

    async def set_weight_version(self, version: str) -> None:
        """Every healthy server tags the tokens it samples with `version`."""
        self.weight_version = version
        await self.call_all(
            _WEIGHT_VERSION, json={"new_version": version}, done=partial(_versioned, version=version)
        )

    def behind(self, server: Server) -> bool:
        """Whether the server lacks reloads or the version the fleet was given."""
        return server.reloads < self.reloads or (
            self.weight_version is not None and server.weight_version != self.weight_version
        )

    async def _catch_up(self, server: Server) -> str | None:
        """Give a server coming (back) into service the weight reloads and version it missed, as the others
        had them; what went wrong, or None."""
        if not self.behind(server):
            return None
        if server.reloads < self.reloads:
            failure = await self._call(server, _RELOAD, json=_RELOAD_BODY)
            if failure is not None:
                return failure
            server.reloads = self.reloads
        if self.weight_version is not None and server.weight_version != self.weight_version:
            failure = await self._call(server, _WEIGHT_VERSION, json={"new_version": self.weight_version})
            if failure is not None:
                return failure
            server.weight_version = self.weight_version
        self.caught_up(server)
        return None

    async def post_any(self, path: str, body: object, model: str | None) -> tuple[int, bytes]:
        """POST to any healthy server that serves `model`, without routing a rollout (reads such as
        `/detokenize`); the first server that answers does."""
        last_error: Exception | None = None
        for server in [s for s in self.servers.values() if usable(s, model)]:
            try:
                async with self._session.post(server.url + path, json=body) as response:
                    return response.status, await response.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                last_error = exc
        raise BackendFailure("unreachable", f"no backend serving {model!r} reachable: {last_error!r}")

    async def get(self, path: str) -> tuple[int, bytes]:
        last_error: Exception | None = None
        for server in sorted(self.servers.values(), key=lambda s: not s.healthy):
            try:
                async with self._session.get(server.url + path) as response:
                    return response.status, await response.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                last_error = exc
        raise BackendFailure("unreachable", f"no backend reachable: {last_error!r}") from last_error

    async def check(self, server: Server) -> None:
        """One health check: /health, then (when it passes) the served models and prefix-cache hit rate."""
        try:
            async with self._session.get(server.url + "/health", timeout=_CHECK_TIMEOUT) as response:
                ok = response.status == 200
        except Exception:  # whatever stops a probe, the server is not serving
            ok = False
        if ok:
            try:  # what it serves and how its cache does: worth knowing, but not a health matter
                server.models = await self._models(server)
                server.prefix_cache_hit_rate = await self._prefix_hit_rate(server)
            except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
                log.debug("backend %s: no models or metrics (%r)", server.url, exc)
            if not server.healthy:
                if not self.gives_weights():
                    if self.behind(server):  # the leading process gives them, then tells this one
                        log.debug("backend %s waits for the fleet's weights", server.url)
                        return
                else:
                    missed = await self._catch_up(server)
                    if missed is not None:
                        log.warning(
                            "backend %s not admitted: it could not take the fleet's weights (%s)",
                            server.url,
                            missed,
                        )
                        server.failed_checks += 1
                        return
                log.info("backend %s healthy: admitted", server.url)
            server.healthy, server.failed_checks = True, 0
            return
        server.failed_checks += 1
        if server.failed_checks >= self.eject_after:
            self._eject(server, f"{server.failed_checks} health checks failed")

    async def _models(self, server: Server) -> frozenset[str]:
        async with self._session.get(server.url + "/v1/models", timeout=_CHECK_TIMEOUT) as response:
            listed = (await response.json()).get("data") or ()
        return frozenset(str(m.get("id")) for m in listed if isinstance(m, dict))

    async def _prefix_hit_rate(self, server: Server) -> float | None:
        async with self._session.get(server.url + "/metrics", timeout=_CHECK_TIMEOUT) as response:
            if response.status != 200:
                return None
            text = await response.text()
        return prefix_hit_rate(text.splitlines())

    async def monitor(
        self, interval: float, discovery: Callable[[], Iterable[str] | None] | None = None
    ) -> None:
        """Check every server each `interval` seconds (and re-read the discovery file), until cancelled."""
        while True:
            if discovery is not None:
                self.discovered(discovery())
            await asyncio.gather(*(self.check(server) for server in list(self.servers.values())))
            await asyncio.sleep(interval)

    def discovered(self, urls: Iterable[str] | None) -> None:
        """The servers a discovery file lists now (None: unchanged): new ones join, missing ones leave."""
        if urls is None:
            return
        wanted = [url.rstrip("/") for url in urls]
        for url in wanted:
            if url not in self.servers:
                self.add(url)
        for url in list(self.servers):
            if url not in wanted and len(self.servers) > 1:
                self.remove(url)

    async def close(self) -> None:
        await self._session.close()


_CHECK_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_RELOAD, _RELOAD_BODY = "/collective_rpc", {"method": "reload_weights"}
_WEIGHT_VERSION = "/update_weight_version"


def _reloaded(server: Server, reloads: int) -> None:
    server.reloads = reloads


def _versioned(server: Server, version: str) -> None:
    server.weight_version = version


def _left(server: Server) -> None:
    server.in_flight -= 1


def _none_for(model: str | None, servers: Iterable[Server]) -> str:
    listed = ", ".join(
        f"{s.url} ({'draining' if s.draining else 'healthy' if s.healthy else 'ejected'})" for s in servers
    )
    return f"no healthy backend takes new rollouts for model {model!r}: {listed}"


def prefix_hit_rate(lines: Iterable[str]) -> float | None:
    """vLLM's prefix-cache hit rate from its Prometheus text: hits over queries (in tokens), summed over its
    engines; None before any query."""
    totals = {"hits": 0.0, "queries": 0.0}
    for line in lines:
        if line.startswith("vllm:prefix_cache_"):
            name, _, value = line.rpartition(" ")
            for kind in totals:
                if name.startswith(f"vllm:prefix_cache_{kind}_total"):
                    totals[kind] += float(value)
    return totals["hits"] / totals["queries"] if totals["queries"] else None
