"""Rollouts nobody finishes: a running rollout with no call and no control request for the idle limit
(`--rollout-idle-timeout`) is expired, so that it stops holding a seat on its server and its group is served.

A rollout's last activity is read from what the store already holds: its creation, its turns (each stored
when its call ends) and its rewards. Expiry is one conditional UPDATE, idempotent, so that any process may
run it; on PostgreSQL the rollouts are first locked as every write of the gateway locks them
(`operations.lock_rollouts`), and the condition is checked again under the locks, so that a turn another
process is committing at that moment either lands first (and the rollout is not idle) or after (and is
refused, the rollout being expired).
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import ColumnElement, and_, exists, select, update
from sqlalchemy.engine import Connection

from rollout_store import schema
from rollout_store.status import RolloutStatus

BATCH = 1000
"""Rollouts expired per transaction at most: a run that abandoned many at once is expired in several."""


def idle_since(cutoff: float) -> ColumnElement[bool]:
    """Running, and nothing happened to it since `cutoff`."""
    r, t, w = schema.rollouts, schema.turns, schema.rewards
    return and_(
        r.c.status == RolloutStatus.RUNNING,
        r.c.created_at < cutoff,
        ~exists().where(t.c.rollout_id == r.c.rollout_id, t.c.finished_at >= cutoff),
        ~exists().where(w.c.rollout_id == r.c.rollout_id, w.c.created_at >= cutoff),
    )


def idle_rollouts(conn: Connection, cutoff: float) -> list[str]:
    """The rollouts to expire: read first, so that the expiring transaction locks them all up front."""
    r = schema.rollouts
    query = select(r.c.rollout_id).where(idle_since(cutoff)).order_by(r.c.rollout_id).limit(BATCH)
    return list(conn.execute(query).scalars())


def expire(conn: Connection, rollout_ids: Collection[str], cutoff: float, now: float) -> list[str]:
    """Expire those of `rollout_ids` still idle since `cutoff` (locked by the caller's transaction); the ones
    it expired."""
    r = schema.rollouts
    expired = conn.execute(
        update(r)
        .where(r.c.rollout_id.in_(rollout_ids), idle_since(cutoff))
        .values(status=RolloutStatus.EXPIRED, finished_at=now)
        .returning(r.c.rollout_id)
    )
    return sorted(expired.scalars())
