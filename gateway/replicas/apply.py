"""This process holding the run state: what it holds now, and taking a newer one (its pause, policy version,
weights, adapter versions and servers with their health)."""

from __future__ import annotations

from gateway.fleet.fleet import Fleet
from gateway.fleet.servers import Server
from gateway.fleet.weight_versions import FleetWeights
from gateway.store.run_state import RunState, ServerEntry
from gateway.turns.recording import Recorder
from gateway.turns.traffic import Traffic


def held_by(fleet: Fleet, traffic: Traffic, recorder: Recorder, epoch: int = 0) -> RunState:
    """The run state as this process holds it."""
    return RunState(
        epoch=epoch,
        policy_version=recorder.policy_version,
        paused=traffic.paused,
        cache_kept=recorder.cache_kept,
        reloads=fleet.weights.reloads,
        weight_version=fleet.weights.version,
        adapters=list(fleet.adapters.versions),
        servers=[_entry(server) for server in fleet.servers.values()],
    )


def _entry(server: Server) -> ServerEntry:
    return ServerEntry(
        url=server.url,
        draining=server.draining,
        healthy=server.healthy,
        models=sorted(server.models),
        prefix_cache_hit_rate=server.prefix_cache_hit_rate,
        weight_spans=server.weight_spans,
        reloads=server.reloads,
        weight_version=server.weight_version,
        adapter_errors=dict(server.adapter_errors),
    )


def adopt(state: RunState, fleet: Fleet, traffic: Traffic, recorder: Recorder) -> None:
    """Hold `state`: its pause, policy version, weights and servers."""
    if state.paused:
        traffic.close()
    else:
        traffic.open()
    recorder.policy_version = state.policy_version
    recorder.cache_kept = state.cache_kept
    fleet.weights = FleetWeights(state.reloads, state.weight_version)
    fleet.adapters.versions = list(state.adapters)
    for entry in state.servers:
        server = fleet.add(entry.url)
        server.draining, server.healthy = entry.draining, entry.healthy
        server.models, server.prefix_cache_hit_rate = frozenset(entry.models), entry.prefix_cache_hit_rate
        server.weight_spans = entry.weight_spans
        server.reloads, server.weight_version = entry.reloads, entry.weight_version
        server.adapter_errors = dict(entry.adapter_errors)
    wanted = {entry.url for entry in state.servers}
    for url in [url for url in fleet.servers if url not in wanted]:
        fleet.remove(url)
