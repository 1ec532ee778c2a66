"""What the gateway's worker processes share: the fleet (its servers, their weights, the policy version, the
pause), which every process must hold alike, and their loads, which add up.

Admin changes are made by the process that received them and then handed to the others as a whole `Fleet`;
a process that starts (or restarts) takes it from a running one.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel

from gateway.state import GatewayState


class ServerWeights(BaseModel):
    url: str
    draining: bool
    reloads: int
    weight_version: str | None


class Fleet(BaseModel):
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
    in_flight: int
    waiting: int
    servers: dict[str, ServerLoad]

    def worker(self) -> dict[str, int]:
        """As `GET /admin/state` lists it (`WorkerView`)."""
        requests = sum(server.requests for server in self.servers.values())
        return {"pid": self.pid, "in_flight": self.in_flight, "waiting": self.waiting, "requests": requests}


def fleet_of(state: GatewayState) -> Fleet:
    pool = state.backends
    return Fleet(
        paused=state.traffic.paused,
        policy_version=state.recorder.policy_version,
        reloads=pool.reloads,
        weight_version=pool.weight_version,
        servers=[
            ServerWeights(url=s.url, draining=s.draining, reloads=s.reloads, weight_version=s.weight_version)
            for s in pool.servers.values()
        ],
    )


async def adopt(state: GatewayState, fleet: Fleet, *, pause: bool = False) -> None:
    """Hold the fleet as another process does: its servers (new ones checked at once), their weights and the
    policy version; with `pause`, its pause as well (a process joining a paused gateway starts paused)."""
    pool = state.backends
    state.recorder.policy_version = fleet.policy_version
    pool.reloads, pool.weight_version = fleet.reloads, fleet.weight_version
    joined = []
    for entry in fleet.servers:
        known = entry.url in pool.servers
        server = pool.add(entry.url)
        server.draining = entry.draining
        server.reloads, server.weight_version = entry.reloads, entry.weight_version
        if not known:
            joined.append(server)
    wanted = {entry.url for entry in fleet.servers}
    for url in [url for url in pool.servers if url not in wanted]:
        pool.remove(url)
    for server in joined:
        await pool.check(server)
    if pause:
        if fleet.paused:
            state.traffic.close()
        else:
            state.traffic.open()


def load_of(state: GatewayState) -> Load:
    return Load(
        pid=os.getpid(),
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
                for field in ("in_flight", "pinned", "requests", "errors"):
                    backend[field] += getattr(theirs, field)
    return state
