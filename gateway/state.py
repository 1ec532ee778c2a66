"""What every request handler shares: settings, store, backends, metrics."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.admin.traffic import Traffic
from gateway.backend import BackendPool
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.store.store import Store


@dataclass
class GatewayState:
    settings: Settings
    store: Store
    backends: BackendPool
    metrics: Metrics
    policy_version: str
    traffic: Traffic


async def get_state(request: Request) -> GatewayState:
    """A FastAPI dependency; async, so that FastAPI does not run it in a worker thread."""
    return request.app.state.gateway
