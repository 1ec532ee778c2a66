"""What the admin API works with, handed to it by the app."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.fleet.engine import Engine
from gateway.fleet.fleet import Fleet
from gateway.replicas.replica import Replica
from gateway.store.store import Store
from gateway.turns.recording import Recorder


@dataclass(frozen=True)
class AdminContext:
    replica: Replica
    """This process, through which a change reaches every process of the gateway."""
    fleet: Fleet
    engine: Engine
    recorder: Recorder
    store: Store
    """Where the versions the run publishes are kept in order (`policy_versions`)."""
    clear_cache: bool
    """Whether a pause that does not say drops the servers' caches (--pause-clear-cache)."""


async def admin_context(request: Request) -> AdminContext:
    context: AdminContext = request.app.state.admin
    return context
