"""This process holding the fleet: what it holds now, and taking a newer one (its pause, policy version,
weights and servers with their health)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.fleet.records import FleetState, ServerEntry
from gateway.fleet.servers import Server
from gateway.fleet.weights import FleetWeights

if TYPE_CHECKING:
    from gateway.state import GatewayState


def fleet_of(state: GatewayState, epoch: int = 0) -> FleetState:
    """The fleet as this process holds it."""
    pool = state.backends
    return FleetState(
        epoch=epoch,
        policy_version=state.recorder.policy_version,
        paused=state.traffic.paused,
        reloads=pool.weights.reloads,
        weight_version=pool.weights.version,
        servers=[entry_of(server) for server in pool.servers.values()],
    )


def entry_of(server: Server) -> ServerEntry:
    return ServerEntry(
        url=server.url,
        draining=server.draining,
        healthy=server.healthy,
        models=sorted(server.models),
        prefix_cache_hit_rate=server.prefix_cache_hit_rate,
        reloads=server.reloads,
        weight_version=server.weight_version,
    )


def adopt(state: GatewayState, fleet: FleetState) -> None:
    """Hold `fleet`: its pause, policy version, weights and servers."""
    if fleet.paused:
        state.traffic.close()
    else:
        state.traffic.open()
    state.recorder.policy_version = fleet.policy_version
    pool = state.backends
    pool.weights = FleetWeights(fleet.reloads, fleet.weight_version)
    for entry in fleet.servers:
        server = pool.add(entry.url)
        server.draining, server.healthy = entry.draining, entry.healthy
        server.models, server.prefix_cache_hit_rate = frozenset(entry.models), entry.prefix_cache_hit_rate
        server.reloads, server.weight_version = entry.reloads, entry.weight_version
    wanted = {entry.url for entry in fleet.servers}
    for url in [url for url in pool.servers if url not in wanted]:
        pool.remove(url)
