"""Which vLLM server each rollout is pinned to, kept in the store so that every gateway replica sends a
rollout's calls to the same server (its prefix cache holds the rollout's history).

A pin is set by compare-and-set: a replica keeps the stored pin while that server can serve, and replaces it
only if the server it saw pinned is still the stored one. Two replicas choosing at once therefore agree on
whichever wrote first.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from gateway.store import schema


class Pin(NamedTuple):
    url: str
    """The server the rollout's calls go to."""
    left: str | None
    """The server it was moved off, if it moved."""
    placed: bool
    """Whether this call placed it there (rather than finding it there, or another replica placing it)."""


MISSING = "missing"
"""`pin`'s answer for a rollout that has no row yet (created on its first call)."""


def pin(conn: Connection, rollout_id: str, candidate: str, usable: Collection[str]) -> Pin | str:
    """The stored pin if it is `usable`, else `candidate`. MISSING if the rollout has no row."""
    r = schema.rollouts
    row = conn.execute(select(r.c.backend).where(r.c.rollout_id == rollout_id)).first()
    if row is None:
        return MISSING
    current = row.backend
    if current is not None and current in usable:
        return Pin(current, None, placed=False)
    condition = r.c.backend.is_(None) if current is None else r.c.backend == current
    moved = conn.execute(
        update(r).where(r.c.rollout_id == rollout_id, condition).values(backend=candidate)
    ).rowcount
    if moved:
        return Pin(candidate, current, placed=True)
    # Another replica moved it first: its choice stands.
    won = conn.execute(select(r.c.backend).where(r.c.rollout_id == rollout_id)).scalar_one()
    return Pin(str(won), current, placed=False)
