"""Claims: each rollout is trained on by one trainer at most.

A claim runs in one write transaction: find ready groups, lock their unclaimed rollouts, stamp them with the
trainer id and step (with a skip reason for those not served). On PostgreSQL the lock is
`FOR UPDATE SKIP LOCKED`, so concurrent trainers skip each other's groups instead of waiting; a group whose
rollouts another trainer holds in part is left to it. On SQLite the transaction itself is exclusive.

A claim taken with a lease holds until the trainer commits it (its step is done) or the lease runs out: a
trainer killed mid-step gives its rollouts back to the others without anyone cleaning up after it.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from rollout_store import schema
from training_data.groups import (
    ROLLOUT_COLUMNS,
    SampleOptions,
    Selection,
    claimable,
    classify,
    load_rollouts,
    policy_is,
    ready_groups,
)


def claim_groups(
    conn: Connection, trainer_id: str, step: int, options: SampleOptions, lease: float | None = None
) -> Selection:
    """Inside a write transaction: claim ready groups for `trainer_id` and return what to train on."""
    r = schema.rollouts
    now = time.time()
    groups = ready_groups(conn, options, unclaimed_only=True, now=now)
    if not groups:
        return Selection()
    unclaimed = (r.c.group_id.in_(groups), claimable(now), r.c.eval.is_(False), *policy_is(options.policy))
    query = select(*ROLLOUT_COLUMNS).where(*unclaimed)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    locked = conn.execute(query).all()
    expected: dict[str, int] = dict(
        conn.execute(select(r.c.group_id, func.count()).where(*unclaimed).group_by(r.c.group_id)).all()
    )
    held = Counter(row.group_id for row in locked)
    whole = [row for row in locked if held[row.group_id] == expected.get(row.group_id)]
    selection = classify(load_rollouts(conn, whole), options)
    reasons: dict[str | None, list[str]] = defaultdict(list)
    for info in selection.rollouts + selection.skipped:
        reasons[info.skip_reason].append(info.rollout_id)
    for reason, ids in reasons.items():
        conn.execute(
            update(r)
            .where(r.c.rollout_id.in_(ids))
            .values(
                claimed_by=trainer_id,
                claim_step=step,
                claimed_at=now,
                skip_reason=reason,
                lease_until=now + lease if lease is not None and reason is None else None,
            )
        )
    return selection


def renew_claims(conn: Connection, trainer_id: str, step: int, lease: float) -> int:
    """Extend the leases `trainer_id` holds for `step` to `lease` seconds from now; returns the count."""
    r = schema.rollouts
    result = conn.execute(
        update(r)
        .where(r.c.claimed_by == trainer_id, r.c.claim_step == step, r.c.lease_until.is_not(None))
        .values(lease_until=time.time() + lease)
    )
    return int(result.rowcount)


def commit_claims(conn: Connection, trainer_id: str, step: int) -> int:
    """Keep for good what `trainer_id` claimed at `step` under a lease (unless another trainer took it after
    the lease ran out); returns the count."""
    r = schema.rollouts
    result = conn.execute(
        update(r)
        .where(r.c.claimed_by == trainer_id, r.c.claim_step == step, r.c.lease_until.is_not(None))
        .values(lease_until=None)
    )
    return int(result.rowcount)


def release_claims(conn: Connection, trainer_id: str, step: int | None = None) -> int:
    """Give back what `trainer_id` claimed (at `step`, or at any step) and did not skip; returns the count."""
    r = schema.rollouts
    condition = [r.c.claimed_by == trainer_id, r.c.skip_reason.is_(None)]
    if step is not None:
        condition.append(r.c.claim_step == step)
    result = conn.execute(
        update(r)
        .where(*condition)
        .values(claimed_by=None, claim_step=None, claimed_at=None, lease_until=None)
    )
    return int(result.rowcount)
