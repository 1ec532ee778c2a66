"""What the gateway's worker processes share: the fleet (its servers, their weights, the policy version, the
pause), which every process must hold alike, and their loads, which add up.

Admin changes are made by the process that received them and then handed to the others as a whole `Fleet`,
numbered so that an older one arriving late changes nothing; a process that starts (or restarts) takes the
newest a running one holds.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pydantic import BaseModel

from gateway.fleet.servers import Server
from gateway.state import GatewayState
from gateway.workers.peers import Peers

log = logging.getLogger(__name__)


class ServerWeights(BaseModel):
    url: str
    draining: bool
    reloads: int
    weight_version: str | None


class Fleet(BaseModel):
    generation: int
    """Admin changes made so far: a process keeps the fleet of the highest it has seen."""
    paused: bool
    policy_version: str
    reloads: int
    weight_version: str | None
    servers: list[ServerWeights]


class ServerLoad(BaseModel):
    in_flight: int
    pinned: int
    requests: int
    errors: int


class Load(BaseModel):
    """One process's share of the work: what it adds to the gateway's numbers."""

    pid: int
    policy_version: str
    in_flight: int
    waiting: int
    servers: dict[str, ServerLoad]

    def worker(self) -> dict[str, object]:
        """As `GET /admin/state` lists it (`WorkerView`)."""
        requests = sum(server.requests for server in self.servers.values())
        return {
            "pid": self.pid,
            "policy_version": self.policy_version,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "requests": requests,
        }


def fleet_of(state: GatewayState, generation: int) -> Fleet:
    pool = state.backends
    return Fleet(
        generation=generation,
        paused=state.traffic.paused,
        policy_version=state.recorder.policy_version,
        reloads=pool.reloads,
        weight_version=pool.weight_version,
        servers=[weights_of(server) for server in pool.servers.values()],
    )


async def share(state: GatewayState, peers: Peers) -> None:
    """Hand this process's fleet, after an admin change made here, to the other processes."""
    peers.generation += 1
    await peers.ask("/fleet", fleet_of(state, peers.generation).model_dump())


def receive(state: GatewayState, peers: Peers, fleet: Fleet, *, pause: bool = False) -> None:
    """Another process's fleet, unless this one already holds a newer one; servers new here are checked in
    the background (a check can take a while: a returning server's weights)."""
    if fleet.generation < peers.generation:
        return
    peers.generation = fleet.generation
    for server in adopt(state, fleet, pause=pause):
        peers.keep(state.backends.check(server))


def adopt(state: GatewayState, fleet: Fleet, *, pause: bool = False) -> list[Server]:
    """Hold the fleet as another process does: the policy version, the weights (a server behind them takes no
    calls until it has them), and, unless a `--backend-file` lists them for every process, the servers; with
    `pause`, its pause as well (a process joining a paused gateway starts paused). The servers new here, to
    be checked."""
    if pause:
        if fleet.paused:
            state.traffic.close()
        else:
            state.traffic.open()
    pool = state.backends
    state.recorder.policy_version = fleet.policy_version
    pool.reloads, pool.weight_version = fleet.reloads, fleet.weight_version
    listed = state.settings.backend_file is None
    joined = []
    for entry in fleet.servers:
        server = pool.servers.get(entry.url)
        if server is None:
            if not listed:
                continue
            server = pool.add(entry.url)
            joined.append(server)
        server.draining = entry.draining
        take_weights(state, entry)
    if listed:
        wanted = {entry.url for entry in fleet.servers}
        for url in [url for url in pool.servers if url not in wanted]:
            pool.remove(url)
    return joined


def take_weights(state: GatewayState, entry: ServerWeights) -> None:
    """What another process says a server holds; one behind the fleet's weights leaves service until the
    leading process has given it them."""
    server = state.backends.servers.get(entry.url)
    if server is None:
        return
    server.reloads, server.weight_version = entry.reloads, entry.weight_version
    if state.backends.behind(server) and server.healthy:
        server.healthy = False
        log.warning("backend %s is behind the fleet's weights: out of service until it has them", server.url)


def weights_of(server: Server) -> ServerWeights:
    return ServerWeights(
        url=server.url, draining=server.draining, reloads=server.reloads, weight_version=server.weight_version
    )


def load_of(state: GatewayState) -> Load:
    return Load(
        pid=os.getpid(),
        policy_version=state.recorder.policy_version,
        in_flight=state.traffic.in_flight,
        waiting=state.traffic.waiting,
        servers={
            s.url: ServerLoad(in_flight=s.in_flight, pinned=s.pinned, requests=s.requests, errors=s.errors)
            for s in state.backends.servers.values()
        },
    )


def add_loads(state: dict[str, Any], loads: list[Load]) -> dict[str, Any]:
    """The admin state of this process (`AdminState` fields) with the other processes' loads added."""
    for load in loads:
        state["workers"].append(load.worker())
        state["in_flight"] += load.in_flight
        state["waiting"] += load.waiting
        for backend in state["backends"]:
            theirs = load.servers.get(backend["url"])
            if theirs is not None:
                for field in ServerLoad.model_fields:
                    backend[field] += getattr(theirs, field)
    return state
