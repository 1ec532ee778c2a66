"""What the viewer shows, read from the store. Fast on a large store: the page's rollouts are chosen first
(newest first, filtered, limited), and only their turns are aggregated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, case, cast, func, select
from sqlalchemy.engine import Connection

from gateway.store import schema
from gateway.store.evaluation import evaluation_report
from gateway.store.status import TurnStatus

PAGE = 200
"""Rollouts per overview page."""


@dataclass(frozen=True)
class Filters:
    group: str | None = None
    tag: str | None = None
    status: str | None = None
    version: str | None = None
    """The policy version of the rollout's first turn."""


def rollouts(conn: Connection, filters: Filters, limit: int = PAGE) -> list[dict[str, Any]]:
    """The newest rollouts that pass `filters`, with their turn, token, error and drift counts."""
    r, t = schema.rollouts, schema.turns
    first = t.alias("first_turn")
    query = (
        select(
            r.c.rollout_id,
            r.c.group_id,
            r.c.task_id,
            r.c.status,
            r.c.reward,
            r.c.tags,
            r.c.eval,
            r.c.end_reason,
            r.c.created_at,
            r.c.finished_at,
            first.c.policy_version,
        )
        .join(first, (first.c.rollout_id == r.c.rollout_id) & (first.c.turn_index == 0), isouter=True)
        .order_by(r.c.created_at.desc())
        .limit(limit)
    )
    if filters.group:
        query = query.where(r.c.group_id == filters.group)
    if filters.status:
        query = query.where(r.c.status == filters.status)
    if filters.version:
        query = query.where(first.c.policy_version == filters.version)
    if filters.tag == "eval":
        query = query.where(r.c.eval.is_(True))
    elif filters.tag:  # tags are a JSON list of strings: the quoted tag in its text
        quoted = '"' + filters.tag.replace("\\", "\\\\").replace('"', '\\"') + '"'
        query = query.where(cast(r.c.tags, String).contains(quoted, autoescape=True))
    found = [dict(row._mapping) for row in conn.execute(query)]
    counts = _turn_counts(conn, [row["rollout_id"] for row in found])
    for row in found:
        row.update(counts.get(row["rollout_id"], _NO_TURNS))
    return found


_NO_TURNS = {"turns": 0, "prompt_tokens": 0, "completion_tokens": 0, "errors": 0, "drifted": 0, "forks": 0}


def _turn_counts(conn: Connection, rollout_ids: list[str]) -> dict[str, dict[str, int]]:
    if not rollout_ids:
        return {}
    t = schema.turns
    failed = t.c.status.in_([TurnStatus.ERROR, TurnStatus.CANCELLED])
    query = (
        select(
            t.c.rollout_id,
            func.count().label("turns"),
            func.coalesce(func.sum(t.c.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(t.c.completion_tokens), 0).label("completion_tokens"),
            func.sum(case((failed, 1), else_=0)).label("errors"),
            func.sum(case((t.c.drift_tokens > 0, 1), else_=0)).label("drifted"),
            func.sum(case((t.c.forked_from.is_not(None), 1), else_=0)).label("forks"),
        )
        .where(t.c.rollout_id.in_(rollout_ids))
        .group_by(t.c.rollout_id)
    )
    return {
        row.rollout_id: {key: int(value) for key, value in row._mapping.items() if key != "rollout_id"}
        for row in conn.execute(query)
    }


def reward_by_version(conn: Connection) -> dict[str, Any]:
    """Mean reward and pass@1 per policy version, of training and of evaluation rollouts, as
    `trainer-client eval` reports them."""
    return {
        "training": evaluation_report(conn, tagged_eval=False)["policy_versions"],
        "evaluation": evaluation_report(conn, tagged_eval=True)["policy_versions"],
    }
