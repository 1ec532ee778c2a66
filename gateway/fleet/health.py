"""Health checks of the vLLM servers, by one process for the whole gateway (the leading one,
`gateway.fleet.sync`), which publishes what it finds in the fleet's state for every process to follow; it
also reads the --backend-file, and any process publishes a server a call could not connect to as ejected.

A check asks /health, then (when it passes) the served models and the prefix-cache hit rate. A server fails
`eject_after` checks in a row before it is ejected; one passing check re-admits it, once it holds the fleet's
weights: a server coming back is first given the reloads and version it missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from gateway.fleet.discovery import BackendFile
from gateway.fleet.records import FleetState, ServerEntry
from gateway.fleet.servers import Server
from gateway.fleet.weights import RELOAD, RELOAD_BODY, WEIGHT_VERSION, FleetWeights

if TYPE_CHECKING:
    from gateway.fleet.sync import FleetSync
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

_CHECK_TIMEOUT = aiohttp.ClientTimeout(total=5.0)

Call = Callable[[str, object], Awaitable[str | None]]
"""POST (url, body) to a server: what went wrong, or None (`BackendPool.call_one`)."""


@dataclass
class Found:
    """What one check found of a server: what the fleet's state should say of it. Health and weights are
    changes, None where the check changed nothing: an ejection published while the check ran (a call that
    could not connect) is not undone by a check that began before it."""

    url: str
    models: frozenset[str]
    prefix_cache_hit_rate: float | None
    healthy: bool | None = None
    weights: FleetWeights | None = None
    """The weights it was given to catch up with the fleet."""


async def check(
    session: aiohttp.ClientSession, server: Server, weights: FleetWeights, eject_after: int, call: Call
) -> Found:
    """One health check of `server` (its `failed_checks` count the failures in a row); `call` gives a
    returning server the weights it missed."""
    was_healthy = server.healthy
    found = Found(server.url, server.models, server.prefix_cache_hit_rate)
    if not await _answers(session, server):
        server.failed_checks += 1
        if was_healthy and server.failed_checks >= eject_after:
            log.warning("backend %s ejected: %d health checks failed", server.url, server.failed_checks)
            found.healthy = False
        return found
    try:  # what it serves and how its cache does: worth knowing, but not a health matter
        found.models = await _models(session, server)
        found.prefix_cache_hit_rate = await _prefix_hit_rate(session, server)
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
        log.debug("backend %s: no models or metrics (%r)", server.url, exc)
    server.failed_checks = 0
    if was_healthy:
        return found
    missed = await _catch_up(call, server, weights)
    if missed is not None:
        log.warning("backend %s not admitted: it missed the fleet's weights (%s)", server.url, missed)
        server.failed_checks += 1
        return found
    log.info("backend %s healthy: admitted", server.url)
    found.healthy, found.weights = True, weights
    return found


async def _answers(session: aiohttp.ClientSession, server: Server) -> bool:
    try:
        async with session.get(server.url + "/health", timeout=_CHECK_TIMEOUT) as response:
            return response.status == 200
    except Exception:  # whatever stops a probe, the server is not serving
        return False


async def _catch_up(call: Call, server: Server, weights: FleetWeights) -> str | None:
    """Give a server coming (back) into service the weight reloads and version it missed, as the others had
    them; what went wrong, or None."""
    if server.reloads < weights.reloads:
        failure = await call(server.url + RELOAD, RELOAD_BODY)
        if failure is not None:
            return failure
    if weights.version is not None and server.weight_version != weights.version:
        return await call(server.url + WEIGHT_VERSION, {"new_version": weights.version})
    return None


async def _models(session: aiohttp.ClientSession, server: Server) -> frozenset[str]:
    async with session.get(server.url + "/v1/models", timeout=_CHECK_TIMEOUT) as response:
        listed = (await response.json()).get("data") or ()
    return frozenset(str(m.get("id")) for m in listed if isinstance(m, dict))


async def _prefix_hit_rate(session: aiohttp.ClientSession, server: Server) -> float | None:
    async with session.get(server.url + "/metrics", timeout=_CHECK_TIMEOUT) as response:
        if response.status != 200:
            return None
        text = await response.text()
    rate = prefix_hit_rate(text.splitlines())
    return round(rate, 3) if rate is not None else None


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


async def watch(fleet: FleetSync, state: GatewayState) -> None:
    """Each --health-interval, while this process leads: re-read the --backend-file, check every server,
    and publish what changed."""
    settings = state.settings
    listing = BackendFile(settings.backend_file) if settings.backend_file else None
    while True:
        if fleet.leads:
            try:
                if listing is not None:
                    await listed(fleet, listing.changed())
                servers = list(state.backends.servers.values())
                await found(fleet, *await asyncio.gather(*map(state.backends.check, servers)))
            except Exception as exc:  # the store or a server failed this round: the next one tries again
                log.warning("health checks failed to publish: %r", exc)
        await asyncio.sleep(settings.health_interval)


async def found(fleet: FleetSync, *findings: Found) -> None:
    """What health checks found of the servers becomes the fleet's."""

    def health(state: FleetState) -> None:
        for seen in findings:
            entry = state.server(seen.url)
            if entry is None:  # removed meanwhile
                continue
            entry.models, entry.prefix_cache_hit_rate = sorted(seen.models), seen.prefix_cache_hit_rate
            if seen.healthy is not None:
                entry.healthy = seen.healthy
            if seen.weights is not None:
                entry.reloads, entry.weight_version = seen.weights.reloads, seen.weights.version

    await fleet.change(health, wait=False)


async def listed(fleet: FleetSync, urls: list[str] | None) -> None:
    """The servers a --backend-file lists now (None: unchanged): new ones join, missing ones leave."""
    if urls is None:
        return
    wanted = [url.rstrip("/") for url in urls]

    def servers(state: FleetState) -> None:
        state.servers += [ServerEntry(url=url) for url in wanted if state.server(url) is None]
        state.servers = [entry for entry in state.servers if entry.url in wanted]

    await fleet.change(servers)


async def ejected(fleet: FleetSync, server: Server) -> None:
    """A call found `server` unreachable: every process stops sending it calls until a check passes."""

    def out(state: FleetState) -> None:
        entry = state.server(server.url)
        if entry is not None:
            entry.healthy = False

    await fleet.change(out, wait=False)
