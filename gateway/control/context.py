"""What the control API and the health routes work with, handed to them by the app."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.fleet.fleet import Fleet
from gateway.replicas.replica import Replica
from gateway.store.store import Store
from gateway.turns.recording import Recorder
from rollout_store.status import Mode


class Lifecycle:
    """Where this process is in its life, as the readiness probe tells it."""

    def __init__(self) -> None:
        self.stopping = False
        """Set as the shutdown begins: a load balancer sends no new calls while those in flight finish."""


@dataclass(frozen=True)
class ControlContext:
    store: Store
    fleet: Fleet
    recorder: Recorder
    replica: Replica
    mode: Mode
    """The gateway's --mode, a rollout's unless it chose its own."""
    rollout_keys: bool
    public_url: str | None
    lifecycle: Lifecycle


async def control_context(request: Request) -> ControlContext:
    context: ControlContext = request.app.state.control
    return context
