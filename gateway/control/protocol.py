"""Request and response models of the control API."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationInfo, field_validator, model_validator

from gateway.encoding import RequestModel
from gateway.ids import ID_PATTERN
from gateway.turns.sampling import Sampling
from rollout_store.status import Mode

MAX_GROUP_SIZE = 65536
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Identifier = Annotated[str, Field(pattern=ID_PATTERN)]


def _non_finite(value: Any, where: str) -> str | None:
    """Where in `value` a NaN or an infinity lies, if anywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}.{key}")
        if found is not None:
            return found
    return None


def _finite(value: Any, info: ValidationInfo) -> Any:
    """Refuse NaN and Infinity in free JSON: Python's JSON parser reads them, but JSON has no form for them,
    so the store would keep null in their place."""
    where = _non_finite(value, str(info.field_name))
    if where is not None:
        raise ValueError(f"{where} is not a finite number (JSON has no NaN or Infinity)")
    return value


FiniteJson = Annotated[dict[str, Any], AfterValidator(_finite)]


class RolloutLimits(RequestModel):
    max_turns: Annotated[int, Field(strict=True, ge=1)] | None = None
    """Model calls the agent may make; the next one is refused (400 `rollout_turn_limit`)."""
    max_context_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    """Prompt + completion tokens of one call; a longer prompt is refused (400 `context_length_exceeded`) and
    a reply is cut to fit (finish_reason `length`)."""


class CreateRolloutRequest(RequestModel):
    rollout_id: Identifier | None = None
    group_id: Identifier | None = None
    group_size: Annotated[int, Field(strict=True, ge=1, le=MAX_GROUP_SIZE)] | None = None
    """How many members the group has: it is served to trainers only once that many have finished. Every
    member may declare it (the same number) or leave it out; one past the size, one declaring another size
    and one created after a trainer took the group are refused (409). Without it, a group is served once none
    of its members is running."""
    task_id: Annotated[str, Field(max_length=256)] | None = None
    metadata: FiniteJson = Field(default_factory=dict)
    mode: Mode | None = None
    """Overrides the gateway's --mode for this rollout's turns."""
    tags: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=32)] | None = (
        None
    )
    """Free labels; "eval" marks an evaluation rollout, never claimed for training."""
    limits: RolloutLimits | None = None
    """Override the gateway's default limits (--max-turns, --max-context-tokens) for this rollout."""
    sampling: Sampling | None = None
    """Sampling fields that replace the agent's own on every call of the rollout (over --sampling);
    `max_tokens` caps what the agent asks."""
    policy: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$")] | None = None
    """The policy the rollout trains (a LoRA policy's name, or a model's), by which trainers claim its group;
    without it, the model of its first call."""

    @field_validator("sampling", mode="before")
    @classmethod
    def _finite_sampling(cls, value: Any, info: ValidationInfo) -> Any:
        """Its numbers are stored and sent to the engine as given: a bound such as `repetition_penalty > 0`
        lets Infinity through, and `structured_outputs` is free JSON."""
        return _finite(value, info)


class RolloutCreated(BaseModel):
    rollout_id: str
    group_id: str
    group_size: int | None
    task_id: str | None
    metadata: dict[str, Any]
    mode: str
    tags: list[str] | None
    limits: RolloutLimits | None
    sampling: dict[str, Any] | None
    policy: str | None
    status: str
    created: bool
    base_url: str
    """What the agent's OPENAI_BASE_URL should be."""
    anthropic_base_url: str
    """What an Anthropic agent's ANTHROPIC_BASE_URL should be (its SDK appends /v1/messages)."""
    api_key: str | None
    """With --rollout-keys: the agent's key for this rollout (its OPENAI_API_KEY), shown once, at creation
    (201); a repeated creation (200) answers null. Without --rollout-keys: null."""


class RewardRequest(RequestModel):
    reward: FiniteFloat
    components: dict[str, FiniteFloat] | None = None
    turn_index: Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)] | None = None


class RewardRecorded(BaseModel):
    rollout_id: str
    reward: float
    components: dict[str, float] | None
    turn_index: int | None


class FinishRequest(RequestModel):
    status: Literal["completed", "failed", "truncated", "aborted"] = "completed"
    reward: FiniteFloat | None = None
    components: dict[str, FiniteFloat] | None = None

    @model_validator(mode="after")
    def _components_need_a_reward(self) -> FinishRequest:
        if self.components is not None and self.reward is None:
            raise ValueError("components are parts of a reward: give the reward too")
        return self


class RolloutFinished(BaseModel):
    rollout_id: str
    group_id: str
    status: str
    reward: float | None
    reward_components: dict[str, float] | None
    created_at: float
    finished_at: float | None


class RewardView(BaseModel):
    turn_index: int | None
    value: float
    components: dict[str, float] | None
    created_at: float


class TurnView(BaseModel):
    """A turn as `GET /rollouts/{id}` shows it; token arrays and messages only when asked for."""

    index: int
    status: Literal["ok", "error", "cancelled", "refused"]
    error: str | None
    http_status: int | None
    endpoint: str
    model: str | None
    stream: bool
    backend: str | None
    repinned_from: str | None
    """The server the rollout was moved off for this call (it failed, was drained away or removed)."""
    policy_version: str | None
    policy_version_end: str | None
    adapter: str | None
    """The LoRA adapter version that sampled it, by its name on the servers (`agent@3`: `model` is its policy,
    `policy_version` its version); null for a model's own weights."""
    cache_kept: bool | None
    """For a turn that spanned a weight update (its policy versions differ): whether the servers kept their
    KV caches through it (its tokens after the update attend to keys and values of the previous weights), or
    computed them again; null for a turn that spanned none."""
    weight_versions: list[dict[str, Any]] | None
    """The weight version of each completion token, as vLLM reports them: spans `{"version", "start", "end"}`
    over the completion's tokens (`end` excluded), in order; two for a turn that spanned a weight update in
    keep mode. Null from a server without the project's vLLM plugin (`vllm-plugin/`), which does not report
    them: `policy_version` and `policy_version_end` bound such a turn's tokens."""
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None
    response_id: str | None
    """Responses: the id the agent continues from (`previous_response_id`) or fetches."""
    choice_index: int
    attempt: int
    retry_of: int | None
    parent_turn: int | None
    forked_from: int | None
    prefix_tokens: int
    drift_tokens: int | None
    splice: str | None
    prompt_tokens: int
    completion_tokens: int
    started_at: float
    first_token_at: float | None
    finished_at: float
    latency_s: float
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float | None] | None = None
    """The engine's sampling logprobs; null where it gave -inf."""
    messages: list[dict[str, Any]] | None = None
    prompt_text: str | None = None
    tools: list[Any] | None = None
    params: dict[str, Any] | None = None
    """The request fields sent to the engine (after the rollout's sampling)."""
    request: dict[str, Any] | None = None
    """The agent's own request when it spoke Messages or Responses, without its conversation."""


class RolloutView(BaseModel):
    rollout_id: str
    group_id: str
    group_size: int | None
    task_id: str | None
    metadata: dict[str, Any]
    status: str
    reward: float | None
    reward_components: dict[str, float] | None
    rewards: list[RewardView]
    created_at: float
    finished_at: float | None
    claimed_by: str | None
    claim_step: int | None
    skip_reason: str | None
    lease_until: float | None
    mode: str
    """How its turns' prompts are built: its own mode, else the gateway's --mode."""
    tags: list[str] | None
    limits: RolloutLimits | None
    sampling: dict[str, Any] | None
    """Sampling fields imposed on the rollout's calls (the gateway's --sampling fills the others)."""
    policy: str | None
    """The policy it trains: as created, else the model of its first call (null before it)."""
    backend: str | None
    """The vLLM server the rollout's calls go to (pinned on its first call)."""
    end_reason: str | None
    """The limit that stopped the rollout's agent, if one did."""
    turns: list[TurnView]


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    policy_version: str
    backends: list[str]


class ModelHealth(BaseModel):
    healthy: int
    total: int


class ServerHealth(BaseModel):
    healthy: bool
    """False while ejected: its checks failed, or a call could not connect."""
    draining: bool
    models: list[str]
    """Model names from its /v1/models (empty until known)."""
    adapter_errors: dict[str, str]
    """LoRA versions it failed to load, and why: it takes none of their policy's calls until it loads them."""


class BackendsHealth(BaseModel):
    healthy: int
    total: int
    models: dict[str, ModelHealth]
    """Servers by model name (a server whose models are not known yet counts for none)."""
    servers: dict[str, ServerHealth]
    """By URL."""


class Readiness(BaseModel):
    ready: bool
    """Whether this process can serve: its store answers, its schema is the one it needs (or newer) and it is
    not shutting down. Unhealthy backends do not make it unready: every process sees the same fleet."""
    reasons: list[str]
    """Why it is not ready (empty when it is)."""
    backends: BackendsHealth
    policy_version: str
    version: str
