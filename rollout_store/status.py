"""Every status and mode the store holds, in one place.

They are `StrEnum`s: stored, compared and sent as their plain string values ("running", "ok", "exact").
"""

from __future__ import annotations

from enum import StrEnum


class RolloutStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    EXPIRED = "expired"
    """Ended by the gateway: no call and no control request for --rollout-idle-timeout (its environment
    died, or forgot it). Trains as a failed member of its group."""


FINISHED = (
    RolloutStatus.COMPLETED,
    RolloutStatus.FAILED,
    RolloutStatus.TRUNCATED,
    RolloutStatus.ABORTED,
    RolloutStatus.EXPIRED,
)
TRAINABLE = (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)
"""Finished rollouts whose turns can train a policy (given a reward)."""


class TurnStatus(StrEnum):
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"
    REFUSED = "refused"
    """Refused by a rollout limit before reaching an engine: the rollout's agent was stopped, not failed."""


class Mode(StrEnum):
    """How a rollout's prompts are built: vLLM's own render of the messages, or spliced onto exact ids."""

    PASSTHROUGH = "passthrough"
    EXACT = "exact"


class Limit(StrEnum):
    """The rollout limits; a rollout stopped by one records it as its `end_reason`."""

    MAX_TURNS = "max_turns"
    MAX_CONTEXT_TOKENS = "max_context_tokens"
