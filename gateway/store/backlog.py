"""What the run holds of work, as the gateway's metrics show it: rollouts running and expired, and groups
ready for a trainer that none has claimed yet (the trainers' backlog)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.engine import Connection

from rollout_store import schema
from rollout_store.status import RolloutStatus


@dataclass(frozen=True)
class Backlog:
    running: int
    """Rollouts running."""
    expired: int
    """Rollouts the gateway expired (`gateway.store.expiry`)."""
    unclaimed_groups: int
    """Groups whose members have all finished (and all been created, for a group declared with a size), of
    which no trainer has claimed any; evaluation rollouts, never trained on, are left out."""


def backlog(conn: Connection) -> Backlog:
    r = schema.rollouts
    running, expired = (
        conn.execute(select(func.count()).where(r.c.status == status)).scalar_one()
        for status in (RolloutStatus.RUNNING, RolloutStatus.EXPIRED)
    )
    # Only groups with a finished rollout no trainer claimed are looked at (`claimed_by` is indexed): a long
    # run's claimed history is not aggregated again at every look.
    waiting = (
        select(r.c.group_id)
        .where(r.c.claimed_by.is_(None), r.c.status != RolloutStatus.RUNNING, r.c.eval.is_(False))
        .distinct()
        .scalar_subquery()
    )
    ready = (
        select(r.c.group_id)
        .where(r.c.group_id.in_(waiting))
        .group_by(r.c.group_id)
        .having(
            func.sum(case((r.c.status == RolloutStatus.RUNNING, 1), else_=0)) == 0,
            func.count(r.c.claimed_by) == 0,
            func.count() >= func.coalesce(func.max(r.c.group_size), 0),
        )
        .subquery()
    )
    unclaimed = conn.execute(select(func.count()).select_from(ready)).scalar_one()
    return Backlog(running=int(running), expired=int(expired), unclaimed_groups=int(unclaimed))
