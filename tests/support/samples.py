"""Training samples built by hand, for the tests of what trains (layouts, merges, shards, trainers' formats):
one builder of a step, and the rollouts several of them share."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from training_data.samples import StepSample


def step(
    turn_index: int,
    prompt: list[int],
    completion: list[int],
    logprobs: list[float],
    *,
    parent_turn: int | None = None,
    masked: bool = False,
    is_last_step: bool = False,
    policy_version: str | None = "0",
    finish_reason: str | None = "stop",
    reward: float = 1.0,
    advantage: float = 0.5,
    choice_reward: bool = False,
    rollout_id: str = "r",
    group_id: str = "g",
) -> StepSample:
    """Turn `turn_index` of rollout `rollout_id` as a trainer reads it: its prompt, completion and the
    engine's logprobs of the completion."""
    return StepSample(
        rollout_id=rollout_id,
        group_id=group_id,
        step=turn_index,
        turn_index=turn_index,
        is_last_step=is_last_step,
        prompt_ids=np.array(prompt, dtype=np.int32),
        completion_ids=np.array(completion, dtype=np.int32),
        logprobs=np.array(logprobs, dtype=np.float32),
        reward=reward,
        reward_components=None,
        advantage=advantage,
        policy_version=policy_version,
        finish_reason=finish_reason,
        masked=masked,
        parent_turn=parent_turn,
        choice_reward=choice_reward,
    )


def last_step(
    rollout_id: str,
    prompt: list[int],
    completion: list[int],
    logprobs: list[float],
    *,
    advantage: float = 0.0,
    reward: float = 0.0,
    turn_index: int = 0,
    **fields: Any,
) -> StepSample:
    """A rollout's last step, with neither reward nor advantage unless given."""
    return step(
        turn_index,
        prompt,
        completion,
        logprobs,
        rollout_id=rollout_id,
        advantage=advantage,
        reward=reward,
        is_last_step=True,
        **fields,
    )


def chain() -> list[StepSample]:
    """Three turns; each prompt is the previous prompt + completion + environment tokens (20, 21 / 30)."""
    return [
        step(0, [1, 2, 3], [10, 11], [-0.5, -0.25], finish_reason="tool_calls"),
        step(1, [1, 2, 3, 10, 11, 20, 21], [12], [-1.0], parent_turn=0, finish_reason="tool_calls"),
        step(
            2,
            [1, 2, 3, 10, 11, 20, 21, 12, 30],
            [13, 14],
            [-2.0, -0.125],
            parent_turn=1,
            is_last_step=True,
            policy_version="1",
        ),
    ]


def sub_agents_and_compaction() -> list[StepSample]:
    """What a harness with sub-agents and compaction sends, in time order: the main call (0), a sub-agent's
    two calls (1, 2), the main conversation resumed with its answer (3, parent 0), a summary call that
    extends it (4), the conversation restarted from the summary (5) and continued (6)."""
    return [
        step(0, [1, 2], [10], [-0.5]),
        step(1, [7, 8], [40], [-0.1]),
        step(2, [7, 8, 40, 41], [42], [-0.2], parent_turn=1),
        step(3, [1, 2, 10, 42], [11], [-0.25], parent_turn=0),
        step(4, [1, 2, 10, 42, 11, 50], [12], [-1.0], parent_turn=3),
        step(5, [9, 12], [13], [-2.0], parent_turn=None),
        step(6, [9, 12, 13, 60], [14], [-3.0], parent_turn=5, is_last_step=True),
    ]


def f32(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def versioned(steps: list[StepSample], current: int) -> list[StepSample]:
    """`steps` with each completion token at the version its turn's `policy_version` names (a number) and its
    staleness against `current`, as a trainer reading with `current_version` gets them."""
    return [
        dataclasses.replace(
            s,
            completion_versions=np.full(
                s.completion_ids.shape[0], int(s.policy_version or 0), dtype=np.int32
            ),
            completion_staleness=np.full(
                s.completion_ids.shape[0], current - int(s.policy_version or 0), dtype=np.int32
            ),
        )
        for s in steps
    ]
