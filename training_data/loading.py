"""Turning stored turns into step-wise samples: full prompts rebuilt from their deltas, ids decoded from the
packed columns with numpy (no per-token Python loop)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.engine import Connection

from rollout_store import schema
from rollout_store.delta import rebuild
from rollout_store.status import TurnStatus
from rollout_store.tokens import unpack_ids, unpack_logprobs
from training_data.groups import RolloutInfo
from training_data.samples import MergedSample, StepSample, merge_steps
from training_data.teacher_scores import load_scores
from training_data.versions import VersionOrder, staleness, token_versions, version_order

_CHUNK = 500  # rollouts per query: keeps IN lists and memory bounded


def load_samples(
    conn: Connection,
    rollouts: list[RolloutInfo],
    *,
    merged: bool = False,
    teacher: str | None = None,
    current_version: int | None = None,
    max_token_staleness: int | None = None,
) -> list[StepSample] | list[MergedSample]:
    """Samples of the given rollouts, in rollout order then step order; `merged` joins exact chains;
    `teacher` attaches that teacher's scores; with `current_version`, each token's staleness, and with
    `max_token_staleness` too the tokens staler than it masked out of the loss."""
    order = version_order(conn)
    stale = _Staleness(order, current_version, max_token_staleness)
    samples: list[Any] = []
    for start in range(0, len(rollouts), _CHUNK):
        chunk = rollouts[start : start + _CHUNK]
        turns = _turns_by_rollout(conn, [r.rollout_id for r in chunk])
        scores: dict[int, np.ndarray] = {}
        if teacher is not None:
            turn_ids = [row["turn_id"] for rows in turns.values() for row in rows if row["completion_ids"]]
            scores = load_scores(conn, teacher, turn_ids)
        for info in chunk:
            steps = _steps(info, turns.get(info.rollout_id, []), scores, stale)
            samples.extend(merge_steps(steps) if merged else steps)
    return samples


def _turns_by_rollout(conn: Connection, rollout_ids: list[str]) -> dict[str, list[Any]]:
    t = schema.turns
    rows = conn.execute(
        select(
            t.c.turn_id,
            t.c.rollout_id,
            t.c.turn_index,
            t.c.status,
            t.c.parent_turn,
            t.c.forked_from,
            t.c.prefix_tokens,
            t.c.prompt_ids,
            t.c.completion_ids,
            t.c.completion_logprobs,
            t.c.model,
            t.c.adapter,
            t.c.policy_version,
            t.c.weight_versions,
            t.c.finish_reason,
            t.c.drift_tokens,
            t.c.retry_of,
        )
        .where(t.c.rollout_id.in_(rollout_ids))
        .order_by(t.c.rollout_id, t.c.turn_index)
    ).mappings()
    grouped: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        grouped[row["rollout_id"]].append(row)
    return grouped


class _Staleness:
    """Each turn's token versions, and against the trainer's version their staleness and mask."""

    def __init__(self, order: VersionOrder, current: int | None, bound: int | None) -> None:
        self.order, self.current, self.bound = order, current, bound

    def of(self, row: Any, tokens: int) -> dict[str, np.ndarray | None]:
        versions = token_versions(self.order, row, tokens)
        if self.current is None:
            return {"completion_versions": versions}
        behind = staleness(self.order, row, versions, self.current)
        dropped = behind > self.bound if self.bound is not None else None
        return {"completion_versions": versions, "completion_staleness": behind, "stale": dropped}


def _steps(
    info: RolloutInfo, rows: list[Any], scores: dict[int, np.ndarray], stale: _Staleness
) -> list[StepSample]:
    full = rebuild(rows)
    steps = [row for row in rows if row["completion_ids"]]
    # A client's retry repeats an earlier attempt: the agent went on with the retry's reply, so the attempt
    # it repeats carries no loss (it is never trained on twice).
    retried = {row["retry_of"] for row in rows if row["retry_of"] is not None}
    samples = []
    for step, row in enumerate(steps):
        turn = row["turn_index"]
        own = info.choice_outcomes.get(turn)
        completion_ids = unpack_ids(row["completion_ids"])
        reward, advantage = own if own is not None else (info.reward or 0.0, info.advantage)
        samples.append(
            StepSample(
                rollout_id=info.rollout_id,
                group_id=info.group_id,
                step=step,
                turn_index=turn,
                is_last_step=step == len(steps) - 1,
                prompt_ids=full[turn].prompt_ids,
                completion_ids=completion_ids,
                logprobs=unpack_logprobs(row["completion_logprobs"]),
                reward=float(reward),
                reward_components=info.turn_components.get(turn) if own else info.reward_components,
                advantage=advantage,
                policy_version=row["policy_version"],
                finish_reason=row["finish_reason"],
                masked=info.masked or row["status"] != TurnStatus.OK or turn in retried,
                parent_turn=row["parent_turn"],
                drift_tokens=row["drift_tokens"],
                choice_reward=own is not None,
                retried=turn in retried,
                teacher_logprobs=scores.get(row["turn_id"]),
                **stale.of(row, completion_ids.shape[0]),
            )
        )
    return samples
