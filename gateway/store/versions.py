"""The run's policy versions in the order it published them (`policy_versions`), so that a trainer counts a
token's staleness in updates of its policy rather than comparing version strings."""

from __future__ import annotations

from sqlalchemy import and_, insert, select
from sqlalchemy.engine import Connection

from rollout_store import schema


def publish_version(conn: Connection, policy: str | None, version: str, at: float) -> bool:
    """Add `version` of `policy` (None: the full weights) after every version published so far, unless it is
    there already (a gateway restarted at the version it had, a replica starting beside others); whether it
    was added."""
    v = schema.policy_versions
    same_policy = v.c.policy.is_(None) if policy is None else v.c.policy == policy
    found = conn.execute(select(v.c.seq).where(and_(same_policy, v.c.version == version)).limit(1)).first()
    if found is not None:
        return False
    conn.execute(insert(v).values(policy=policy, version=version, published_at=at))
    return True
