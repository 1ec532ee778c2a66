"""Plain records passed from the API layers to the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.store.tokens import ID_DTYPE, LOGPROB_DTYPE


def _empty_ids() -> np.ndarray:
    return np.empty(0, dtype=ID_DTYPE)


def _empty_logprobs() -> np.ndarray:
    return np.empty(0, dtype=LOGPROB_DTYPE)


@dataclass
class TurnRecord:
    """One model call as the gateway saw it: the request, the reply and the engine's exact tokens."""

    rollout_id: str
    endpoint: str
    model: str | None
    stream: bool
    policy_version: str
    started_at: float
    messages: list[dict[str, Any]] | None = None
    prompt_text: str | None = None
    tools: list[Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None
    http_status: int | None = None
    backend: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None
    finish_reason: str | None = None
    prompt_ids: np.ndarray = field(default_factory=_empty_ids)
    completion_ids: np.ndarray = field(default_factory=_empty_ids)
    completion_logprobs: np.ndarray = field(default_factory=_empty_logprobs)
    first_token_at: float | None = None
    finished_at: float = 0.0
    splice: str | None = None
    policy_version_end: str | None = None
    """The policy version when the turn finished: differs from `policy_version` if weights changed meanwhile."""
    weight_versions: list[dict[str, Any]] | None = None
    """Exact mode: vLLM's spans of output tokens per weight version."""
    plain_prompt_ids: np.ndarray | None = None
    """Exact mode: the plain render of the messages, against which drift is measured."""


@dataclass
class NewRollout:
    rollout_id: str
    group_id: str | None = None
    task_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    mode: str | None = None
    tags: list[str] | None = None

    @property
    def eval(self) -> bool:
        return "eval" in (self.tags or ())


@dataclass(frozen=True)
class RolloutState:
    status: str
    mode: str | None


@dataclass
class Reward:
    """A reward for a rollout, or for one of its turns when `turn_index` is set."""

    value: float
    components: dict[str, float] | None = None
    turn_index: int | None = None


class StoreError(Exception):
    """A request the store refuses; carries the HTTP status the API answers with."""

    def __init__(self, status_code: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
