"""The fleet as the store holds it and every gateway process holds it alike (`FleetState`), and what each
process reports of itself (`ProcessReport`).

A `FleetState` is numbered by its `epoch`: each admin change makes the next one (`gateway.fleet.sync`), and a
process holds the newest it has seen. Loads are not part of it: each process has its own and they add up.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

PauseMode = Literal["wait", "abort", "keep"]


class ServerEntry(BaseModel):
    url: str
    draining: bool = False
    healthy: bool = False
    """As the leading process's health checks found it (or a process that could not connect to it); a
    server added at run time is not, until a check has passed."""
    models: list[str] = []
    prefix_cache_hit_rate: float | None = None
    reloads: int = 0
    """The fleet's weight reloads this server has done."""
    weight_version: str | None = None
    """The weight version it was given (None: never)."""


class FleetState(BaseModel):
    epoch: int = 0
    policy_version: str
    paused: bool = False
    pause_mode: PauseMode | None = None
    paused_by: str | None = None
    """The process whose admin call paused the gateway."""
    reloads: int = 0
    weight_version: str | None = None
    servers: list[ServerEntry]

    def server(self, url: str) -> ServerEntry | None:
        return next((entry for entry in self.servers if entry.url == url), None)


class ServerLoad(BaseModel):
    """One process's load on one server (rollouts pinned are the store's count, not a process's)."""

    in_flight: int = 0
    requests: int = 0
    errors: int = 0


class ProcessReport(BaseModel):
    """What a process writes with each heartbeat."""

    applied_epoch: int
    in_flight: int
    waiting: int
    ended: int
    """Agent calls that have ended since it started."""
    loads: dict[str, ServerLoad]
    metrics: dict[str, Any] | None = None
    """Its Prometheus samples (`gateway.metrics.samples`); None: unchanged since the last."""


class ProcessRow(ProcessReport):
    """A process as the store lists it."""

    process_id: str
    host: str
    pid: int
    port: int
    started_at: float
    heartbeat_age: float
    """Seconds since its last heartbeat (on the database's clock)."""
