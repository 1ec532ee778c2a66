"""Plain records passed from the API layers to the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_store.status import RolloutStatus
from rollout_store.tokens import ID_DTYPE, LOGPROB_DTYPE


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
    repinned_from: str | None = None
    """The server the rollout was moved off for this call (it failed, was drained away or removed)."""
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
    """The policy version when the turn finished: differs from `policy_version` if weights changed
    meanwhile."""
    adapter: str | None = None
    """The LoRA adapter version that sampled it (its name on the servers); None: the model's own weights."""
    cache_kept: bool | None = None
    """For a turn that spanned a weight update: whether the servers kept their caches through it."""
    weight_versions: list[dict[str, Any]] | None = None
    """The weight version of each completion token, as spans `{"version", "start", "end"}` over them, from a
    server with the project's vLLM plugin; None from one without."""
    plain_prompt_ids: np.ndarray | None = None
    """Exact mode: the plain render of the messages, against which drift is measured."""
    prompt_completions: tuple[tuple[int, int], ...] | None = None
    """Exact mode: where the model's earlier completions lie in the prompt (from the splice)."""
    request: dict[str, Any] | None = None
    """The agent's own request when it spoke another dialect (Messages, Responses), minus its conversation."""
    response_id: str | None = None
    """Responses: the id the agent can continue from or fetch (None with `store: false`)."""
    choice_index: int = 0
    request_hash: str | None = None
    attempt: int = 0
    """The client's retry count (`x-stainless-retry-count`): above 0, this call repeats an earlier one."""
    refused_by: str | None = None
    """The limit that refused the call (status refused): max_turns or max_context_tokens."""
    retry_of: int | None = None
    """Set by the store: the earlier turn of the rollout this one repeats (a client's retry)."""


@dataclass(frozen=True)
class Limits:
    """Per-rollout limits; None: the gateway's default (itself possibly None: no limit)."""

    max_turns: int | None = None
    max_context_tokens: int | None = None

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> Limits:
        value = value or {}
        return cls(value.get("max_turns"), value.get("max_context_tokens"))

    def to_json(self) -> dict[str, int | None] | None:
        if self.max_turns is None and self.max_context_tokens is None:
            return None
        return {"max_turns": self.max_turns, "max_context_tokens": self.max_context_tokens}

    def over(self, defaults: Limits) -> Limits:
        """These limits, with the gaps filled from `defaults`."""
        return Limits(
            self.max_turns if self.max_turns is not None else defaults.max_turns,
            self.max_context_tokens if self.max_context_tokens is not None else defaults.max_context_tokens,
        )


@dataclass
class NewRollout:
    rollout_id: str
    group_id: str | None = None
    group_size: int | None = None
    """The members the group is declared with; None: the size its first member declared, if any."""
    task_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    mode: str | None = None
    tags: list[str] | None = None
    api_key_hash: str | None = None
    limits: Limits = field(default_factory=Limits)
    sampling: dict[str, Any] | None = None
    policy: str | None = None
    """The policy it trains; None: its first call's model."""

    @property
    def eval(self) -> bool:
        return "eval" in (self.tags or ())


@dataclass(frozen=True)
class RolloutState:
    """What the agent path needs to know of a rollout before it forwards a call."""

    status: str
    mode: str | None
    api_key_hash: str | None = None
    limits: Limits = Limits()
    calls: int = 0
    """Model calls answered so far (turns with status ok, one per call whatever its number of choices)."""
    sampling: dict[str, Any] | None = None
    """Sampling fields imposed on the rollout's calls (over the gateway's --sampling)."""
    group_size: int | None = None
    """The members its group was declared with: its first call leads its siblings'."""
    policy: str | None = None
    """The policy it trains (declared, or its first call's model); None until then."""


@dataclass
class Reward:
    """A reward for a rollout, or for one of its turns when `turn_index` is set."""

    value: float
    components: dict[str, float] | None = None
    turn_index: int | None = None


class StoreError(Exception):
    """A write the store refused before writing anything; `code` says why (`gateway.errors` maps it to
    HTTP)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def not_running(rollout_id: str, status: str) -> StoreError:
    """The refusal of a turn or a finish on a rollout that ended: an expired one says so, since its
    environment, not the gateway, is the one that is late."""
    if status == RolloutStatus.EXPIRED:
        return StoreError(
            f"rollout {rollout_id!r} expired: no call or control request came for --rollout-idle-timeout",
            "rollout_expired",
        )
    return StoreError(f"rollout {rollout_id!r} is already {status}", "rollout_finished")
