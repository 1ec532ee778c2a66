"""Teacher scores in the store: which turns a teacher has still to score, their exact ids, and the scores.

A score is a teacher's logprob of every sampled token of one turn, aligned with the turn's `completion_ids`
and packed like its logprobs (`rollout_store.tokens`). Scores are keyed by turn and teacher name, so scoring
again adds only what is missing: a run that stopped half way resumes where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sqlalchemy import ColumnElement, and_, case, exists, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, RowMapping

from rollout_store import schema
from rollout_store.delta import rebuild
from rollout_store.status import RolloutStatus
from rollout_store.tokens import pack_logprobs, unpack_ids, unpack_logprobs


@dataclass(frozen=True)
class ScoreFilter:
    """Which rollouts to score: a group's, or those created at or after `since` (seconds since the epoch), or
    those of the `newest_groups` finished training groups with any left to score (a trainer's next step:
    however many groups too stale to train on wait, each call's work stays bounded)."""

    group_id: str | None = None
    since: float | None = None
    newest_groups: int | None = None


@dataclass
class TurnToScore:
    turn_id: int
    rollout_id: str
    turn_index: int
    prompt_ids: np.ndarray
    completion_ids: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.prompt_ids.shape[0] + self.completion_ids.shape[0])


def unscored(teacher: str) -> ColumnElement[bool]:
    """A turn with sampled tokens that `teacher` has not scored."""
    t, s = schema.turns, schema.teacher_scores
    scored = exists().where(s.c.turn_id == t.c.turn_id, s.c.teacher == teacher)
    return and_(t.c.completion_tokens > 0, ~scored)


def rollouts_to_score(conn: Connection, teacher: str, where: ScoreFilter) -> list[str]:
    """Rollouts with turns `teacher` has not scored yet, oldest first."""
    r, t = schema.rollouts, schema.turns
    query = select(r.c.rollout_id).where(exists().where(t.c.rollout_id == r.c.rollout_id, unscored(teacher)))
    if where.group_id is not None:
        query = query.where(r.c.group_id == where.group_id)
    if where.since is not None:
        query = query.where(r.c.created_at >= where.since)
    if where.newest_groups is not None:
        running = func.sum(case((r.c.status == RolloutStatus.RUNNING, 1), else_=0))
        to_score = func.sum(
            case((exists().where(t.c.rollout_id == r.c.rollout_id, unscored(teacher)), 1), else_=0)
        )
        newest = (
            select(r.c.group_id)
            .where(r.c.eval.is_(False))
            .group_by(r.c.group_id)
            .having(and_(running == 0, to_score > 0))
            .order_by(func.max(r.c.created_at).desc())
            .limit(where.newest_groups)
        )
        query = query.where(r.c.group_id.in_(newest))
    return [row[0] for row in conn.execute(query.order_by(r.c.created_at, r.c.rollout_id))]


def turns_to_score(conn: Connection, teacher: str, rollout_ids: Sequence[str]) -> list[TurnToScore]:
    """The unscored turns of these rollouts with their full prompts (rebuilt from the stored deltas)."""
    t, s = schema.turns, schema.teacher_scores
    rows = conn.execute(
        select(
            t.c.turn_id,
            t.c.rollout_id,
            t.c.turn_index,
            t.c.parent_turn,
            t.c.forked_from,
            t.c.prefix_tokens,
            t.c.prompt_ids,
            t.c.completion_ids,
            exists().where(s.c.turn_id == t.c.turn_id, s.c.teacher == teacher).label("scored"),
        )
        .where(t.c.rollout_id.in_(rollout_ids))
        .order_by(t.c.rollout_id, t.c.turn_index)
    ).mappings()
    by_rollout: dict[str, list[RowMapping]] = {}
    for row in rows:
        by_rollout.setdefault(row["rollout_id"], []).append(row)
    pending = []
    for rollout_id, turns in by_rollout.items():
        full = rebuild(turns)
        for row in turns:
            completion = unpack_ids(row["completion_ids"])
            if row["scored"] or completion.shape[0] == 0:
                continue
            index = row["turn_index"]
            pending.append(TurnToScore(row["turn_id"], rollout_id, index, full[index].prompt_ids, completion))
    return pending


def save_scores(
    conn: Connection, teacher: str, version: str, scores: Sequence[tuple[int, np.ndarray]]
) -> int:
    """Store (turn_id, logprobs) scores in one statement; a turn already scored by `teacher` keeps its
    score. Returns how many were new."""
    if not scores:
        return 0
    now = time.time()
    values = [
        {
            "turn_id": turn_id,
            "teacher": teacher,
            "teacher_version": version,
            "logprobs": pack_logprobs(logprobs),
            "scored_at": now,
        }
        for turn_id, logprobs in scores
    ]
    insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    statement = insert(schema.teacher_scores).values(values).on_conflict_do_nothing()
    return int(conn.execute(statement).rowcount)


def load_scores(conn: Connection, teacher: str, turn_ids: Sequence[int]) -> dict[int, np.ndarray]:
    """`teacher`'s logprobs of these turns' sampled tokens, by turn id (turns it did not score are absent)."""
    s = schema.teacher_scores
    scores: dict[int, np.ndarray] = {}
    for start in range(0, len(turn_ids), 1000):
        chunk = turn_ids[start : start + 1000]
        rows = conn.execute(
            select(s.c.turn_id, s.c.logprobs).where(s.c.teacher == teacher, s.c.turn_id.in_(chunk))
        )
        scores.update((int(turn_id), unpack_logprobs(blob)) for turn_id, blob in rows)
    return scores
