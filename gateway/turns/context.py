"""What the agent path works with, handed to it explicitly (a test can build its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from gateway.fleet.adapters import FleetAdapters
from gateway.fleet.engine import Engine
from gateway.store.records import Limits
from gateway.turns.local_render import LocalRenders
from gateway.turns.recording import Recorder
from gateway.turns.traffic import Traffic
from rollout_store.status import Mode


@dataclass(frozen=True)
class TurnContext:
    recorder: Recorder
    engine: Engine
    traffic: Traffic
    mode: Mode
    """The gateway's --mode; a rollout can choose its own."""
    limits: Limits
    """The gateway's default limits; a rollout's own take precedence."""
    sampling: dict[str, Any] | None
    """The gateway's --sampling: fields imposed on every agent call; a rollout's own take precedence."""
    rollout_keys: bool
    require_registered: bool
    max_body_bytes: int
    local_render: LocalRenders
    """Exact mode's renderers in the gateway's process (`--local-render`); the backend renders the rest."""
    adapters: FleetAdapters = field(default_factory=FleetAdapters)
    """The LoRA policies and their versions (the fleet's)."""
    leader_first: bool = False
    """Whether a group's first call has its prompt computed ahead of its siblings' (`--leader-first`)."""


async def turn_context(request: Request) -> TurnContext:
    context: TurnContext = request.app.state.turns
    return context
