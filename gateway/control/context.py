"""What the control API and the health routes work with, handed to them by the app."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.fleet.pool import BackendPool
from gateway.metrics import Metrics
from gateway.replicas.replica import Replica
from gateway.store.status import Mode
from gateway.store.store import Store
from gateway.turns.recording import Recorder


@dataclass(frozen=True)
class ControlContext:
    store: Store
    backends: BackendPool
    recorder: Recorder
    metrics: Metrics
    replica: Replica
    mode: Mode
    """The gateway's --mode, a rollout's unless it chose its own."""
    rollout_keys: bool
    public_url: str | None


async def control_context(request: Request) -> ControlContext:
    context: ControlContext = request.app.state.control
    return context
