"""Request and response models of the admin API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from gateway.encoding import RequestModel


class PauseRequest(RequestModel):
    mode: Literal["wait", "abort", "keep"] = "wait"
    """wait: let calls in flight finish; abort: have vLLM abort them (they are recorded, finish_reason abort);
    keep: freeze them inside vLLM until resume (they then span the weight update). With abort and keep, calls
    that reach vLLM after it paused are queued there and run after resume."""
    timeout: Annotated[float, Field(gt=0)] = 600.0
    """Seconds to wait for calls in flight to finish (wait)."""


class PolicyVersionRequest(RequestModel):
    version: Annotated[str, Field(min_length=1, max_length=64)]


class AdminState(BaseModel):
    paused: bool
    in_flight: int
    waiting: int
    """Agent calls held by the pause."""
    policy_version: str
    backends: list[str]
