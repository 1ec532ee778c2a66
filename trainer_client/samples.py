"""Step-wise training samples: one per model call, with the engine's exact ids and sampling logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class StepSample:
    """One turn of a rollout, ready for a policy-gradient step.

    `logprobs[i]` is the engine's sampling logprob of `completion_ids[i]`. `loss_mask` covers
    `input_ids = prompt_ids + completion_ids`: 0 on the prompt, 1 on the completion (all 0 when `masked`:
    the rollout had failed or cancelled turns and is kept only for its group's statistics).
    """

    rollout_id: str
    group_id: str
    step: int
    turn_index: int
    is_last_step: bool
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    reward: float
    reward_components: dict[str, float] | None
    advantage: float
    policy_version: str | None
    finish_reason: str | None
    masked: bool = False

    @property
    def input_ids(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, self.completion_ids])

    @property
    def loss_mask(self) -> np.ndarray:
        mask = np.zeros(self.prompt_ids.shape[0] + self.completion_ids.shape[0], dtype=np.int8)
        if not self.masked:
            mask[self.prompt_ids.shape[0] :] = 1
        return mask

    def to_json(self) -> dict[str, Any]:
        """A plain-JSON record (the `export --format jsonl` line)."""
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "step": self.step,
            "turn_index": self.turn_index,
            "is_last_step": self.is_last_step,
            "prompt_ids": self.prompt_ids.tolist(),
            "completion_ids": self.completion_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "reward": self.reward,
            "reward_components": self.reward_components,
            "advantage": self.advantage,
            "policy_version": self.policy_version,
            "finish_reason": self.finish_reason,
            "masked": self.masked,
        }
