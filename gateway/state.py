"""What the app holds for its routers: the control and admin APIs take what they need from here; the agent
path gets only its `TurnContext`."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from gateway.admin.traffic import Traffic
from gateway.fleet.pool import BackendPool
from gateway.fleet.sync import FleetSync
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.store.store import Store
from gateway.turns.context import TurnContext
from gateway.turns.recording import Recorder
from gateway.ui.tokens import TokenTexts


@dataclass(frozen=True)
class GatewayState:
    settings: Settings
    store: Store
    backends: BackendPool
    metrics: Metrics
    traffic: Traffic
    recorder: Recorder
    turns: TurnContext
    token_texts: TokenTexts
    """The viewer's texts of token ids, per model."""
    fleet: FleetSync = field(init=False)
    """The fleet's state as every process of the gateway holds it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fleet", FleetSync(self))


async def get_state(request: Request) -> GatewayState:
    """A FastAPI dependency; async, so that FastAPI does not run it in a worker thread."""
    state: GatewayState = request.app.state.gateway
    return state


async def get_turns(request: Request) -> TurnContext:
    state: GatewayState = request.app.state.gateway
    return state.turns
