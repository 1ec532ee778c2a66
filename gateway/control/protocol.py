"""Request and response models of the control API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.ids import ID_PATTERN

FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Identifier = Annotated[str, Field(pattern=ID_PATTERN)]


class CreateRolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout_id: Identifier | None = None
    group_id: Identifier | None = None
    task_id: Annotated[str, Field(max_length=256)] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["exact", "passthrough"] | None = None
    """Overrides the gateway's --mode for this rollout's turns."""
    tags: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=32)] | None = None
    """Free labels; "eval" marks an evaluation rollout, never claimed for training."""


class RolloutCreated(BaseModel):
    rollout_id: str
    group_id: str
    task_id: str | None
    metadata: dict[str, Any]
    mode: str
    tags: list[str] | None
    status: str
    created: bool
    base_url: str


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: FiniteFloat
    components: dict[str, FiniteFloat] | None = None
    turn_index: Annotated[int, Field(strict=True, ge=0)] | None = None


class RewardRecorded(BaseModel):
    rollout_id: str
    reward: float
    components: dict[str, float] | None
    turn_index: int | None


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
