"""What the leading process finds of the fleet becomes the run state: health checks each --health-interval
(which also load the live LoRA versions a server lacks, and unload retired ones no call holds),
the servers a --backend-file lists, and (from any process) a server a call could not connect to or one a call
that no server took found back (`EngineClient.revive`): `ejected` and `publish_health` are the engine
client's, as `gateway.app.wire` builds it."""

from __future__ import annotations

import asyncio
import logging

from gateway.fleet.discovery import BackendFile
from gateway.fleet.engine import Engine
from gateway.fleet.fleet import Fleet
from gateway.fleet.health import Found
from gateway.fleet.servers import Server
from gateway.replicas import adapters
from gateway.replicas.replica import Replica
from gateway.store.run_state import RunState, ServerEntry

log = logging.getLogger(__name__)


async def checked(
    replica: Replica, fleet: Fleet, engine: Engine, listing: BackendFile | None, interval: float
) -> None:
    """Each `interval` seconds, while this process leads: re-read the --backend-file, check every server,
    and publish what changed."""
    while True:
        if replica.leads:
            try:
                if listing is not None:
                    await listed(replica, listing.changed())
                servers = list(fleet.servers.values())
                await publish_health(replica, *await asyncio.gather(*map(engine.check, servers)))
                await adapters.release(replica, fleet, engine)
            except Exception as exc:  # the store or a server failed this round: the next one tries again
                log.warning("health checks failed to publish: %r", exc)
        await asyncio.sleep(interval)


async def publish_health(replica: Replica, *findings: Found) -> None:
    """What health checks found of the servers becomes the run state's."""

    def health(state: RunState) -> None:
        for seen in findings:
            entry = state.server(seen.url)
            if entry is None:  # removed meanwhile
                continue
            published = {v.name for v in state.adapters} - seen.adapters_checked  # since the check began
            kept = {name for name in entry.models if name in published}
            entry.models, entry.prefix_cache_hit_rate = sorted(seen.models | kept), seen.prefix_cache_hit_rate
            entry.weight_spans = seen.weight_spans
            unchecked = {k: v for k, v in entry.adapter_errors.items() if k not in seen.adapters_checked}
            entry.adapter_errors = unchecked | seen.adapter_errors
            if seen.healthy is not None:
                entry.healthy = seen.healthy
            if seen.weights is not None:
                entry.reloads, entry.weight_version = seen.weights.reloads, seen.weights.version

    await replica.change(health, wait=False)


async def listed(replica: Replica, urls: list[str] | None) -> None:
    """The servers a --backend-file lists now (None: unchanged): new ones join, missing ones leave."""
    if urls is None:
        return
    wanted = [url.rstrip("/") for url in urls]

    def servers(state: RunState) -> None:
        state.servers += [ServerEntry(url=url) for url in wanted if state.server(url) is None]
        state.servers = [entry for entry in state.servers if entry.url in wanted]

    await replica.change(servers)


async def ejected(replica: Replica, server: Server) -> None:
    """A call found `server` unreachable: every process stops sending it calls until a check passes."""

    def out(state: RunState) -> None:
        entry = state.server(server.url)
        if entry is not None:
            entry.healthy = False

    await replica.change(out, wait=False)
