"""Which vLLM server each rollout is pinned to, kept in the store so that every gateway replica sends a
rollout's calls to the same server (its prefix cache holds the rollout's history).

A pin is set by compare-and-set: a replica keeps the stored pin while that server can serve, and replaces it
only if the server it saw pinned is still the stored one. Two replicas choosing at once therefore agree on
whichever wrote first. A new pin is chosen from the store's count of running rollouts on each server, under
a lock on PostgreSQL (held until the transaction commits), so that placements made at the same moment by
every process of the gateway see each other and a server's share is bounded across all of them.

The count is by group (`Loads`): a GRPO group's members share their first prompt, so the servers holding a
rollout's siblings are read in the same transaction, and a group declared with a size holds seats on its home
(the server with most of its members) for the members still to come, so that a burst of groups balances as
groups, not as rollouts that happen to arrive first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

import numpy as np
from sqlalchemy import func, select, text, update
from sqlalchemy.engine import Connection

from gateway.store import reads
from rollout_store import schema
from rollout_store.delta import rebuild
from rollout_store.tokens import unpack_ids


class Pin(NamedTuple):
    url: str
    """The server the rollout's calls go to."""
    left: str | None
    """The server it was moved off, if it moved."""
    placed: bool
    """Whether this call placed it there (rather than finding it there, or another replica placing it)."""


MISSING = "missing"
"""`pin`'s answer for a rollout that has no row yet (created on its first call)."""
MOVES = "moves"
"""`pin`'s answer, asked without `cached`, for a rollout whose stored server cannot keep it: where it goes
depends on which servers' caches hold its history, which the caller looks up on its own loop (`history`,
`gateway.fleet.prefixes`) before asking again with it, so that the transaction, which every other commit
waits for, hashes no ids."""


class Loads(NamedTuple):
    """What a new pin is chosen by, read in its transaction."""

    servers: dict[str, int]
    """Each server's load: its running rollouts, and the seats its declared groups hold for the members
    still to come."""
    group_id: str
    group: dict[str, int]
    """The rollout's group's part of each server's load (its members there, and its seats on its home)."""
    adds: int
    """The load placing the rollout adds: none where its group's home holds a seat for it, its group's
    declared size for a declared group's first member placed (seats for the others come with it), else one."""
    seats: dict[str, int]
    """The part of `group` that is seats, held on its home for a declared group's members still to come: a
    server's load is held to its group's own bound without them (`gateway.fleet.routing.group_bound`)."""
    cached: dict[str, int] | None = None
    """A rollout moving off its server: how many ids of its history each server's cache holds, looked up
    before the transaction (`MOVES`)."""


Pick = Callable[[Loads], str]
"""The server for a new pin, given the fleet's loads."""

_PLACEMENT_LOCK = 0x726C_9A1E


def pin(
    conn: Connection, rollout_id: str, pick: Pick, usable: Collection[str], cached: dict[str, int] | None
) -> Pin | str:
    """The stored pin if it is `usable`, else the server `pick` chooses. MISSING if the rollout has no
    row; MOVES if it must move and `cached` is None."""
    r = schema.rollouts
    row = conn.execute(
        select(r.c.backend, r.c.group_id, r.c.group_size).where(r.c.rollout_id == rollout_id)
    ).first()
    if row is None:
        return MISSING
    current = row.backend
    if current is not None and current in usable:
        return Pin(current, None, placed=False)
    if current is not None and cached is None:
        return MOVES
    _lock_placement(conn)
    fleet = loads(conn, row.group_id, row.group_size)
    candidate = pick(fleet._replace(cached=cached) if current is not None else fleet)
    condition = r.c.backend.is_(None) if current is None else r.c.backend == current
    moved = conn.execute(
        update(r).where(r.c.rollout_id == rollout_id, condition).values(backend=candidate)
    ).rowcount
    if moved:
        return Pin(candidate, current, placed=True)
    # Another replica moved it first: its choice stands.
    won = conn.execute(select(r.c.backend).where(r.c.rollout_id == rollout_id)).scalar_one()
    return Pin(str(won), current, placed=False)


def _lock_placement(conn: Connection) -> None:
    """On PostgreSQL, one placement at a time across the gateway's processes: the lock is held until the
    transaction commits, so the next placement counts this one's pin."""
    if conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_advisory_xact_lock(:key, hashtext(current_schema()))"), {"key": _PLACEMENT_LOCK}
        )


def running_pins(conn: Connection) -> dict[str, int]:
    """Running rollouts pinned to each server."""
    r = schema.rollouts
    counts = conn.execute(
        select(r.c.backend, func.count())
        .where(r.c.status == "running", r.c.backend.is_not(None))
        .group_by(r.c.backend)
    )
    return {str(url): int(count) for url, count in counts}


def loads(conn: Connection, group_id: str, group_size: int | None) -> Loads:
    """The fleet's loads by group, for a new member of `group_id` (declared with `group_size`)."""
    r = schema.rollouts
    rows = conn.execute(
        select(r.c.group_id, r.c.backend, func.count(), func.max(r.c.group_size))
        .where(r.c.status == "running", r.c.backend.is_not(None))
        .group_by(r.c.group_id, r.c.backend)
    )
    groups: dict[str, tuple[dict[str, int], int | None]] = {}
    for group, url, count, size in rows:
        members, _ = groups.setdefault(str(group), ({}, size))
        members[str(url)] = int(count)
    groups.setdefault(group_id, ({}, group_size))  # none of its members placed yet
    servers: dict[str, int] = {}
    own: dict[str, int] = {}
    held: dict[str, int] = {}
    adds = 1
    for group, (members, size) in groups.items():
        seats = max(0, int(size) - sum(members.values())) if size else 0
        home: dict[str, int] = {}
        if members and seats:
            home[min(members, key=lambda url: (-members[url], url))] = seats
        part = {url: count + home.get(url, 0) for url, count in members.items()}
        for url, count in part.items():
            servers[url] = servers.get(url, 0) + count
        if group == group_id:
            own, held = part, home
            adds = (0 if members else seats) if seats else 1
    return Loads(servers, group_id, own, adds, held)


def history(conn: Connection, rollout_id: str) -> np.ndarray | None:
    """The ids of the rollout's last answered turn, its prompt and its reply (None before any)."""
    rows = reads.turns_in_order(conn, rollout_id, replies=False)
    answered = [row["turn_index"] for row in rows if row["status"] == "ok"]
    if not answered:
        return None
    full = rebuild(rows)
    last = next(row for row in rows if row["turn_index"] == answered[-1])
    ids: np.ndarray = np.concatenate(
        [full[last["turn_index"]].prompt_ids, unpack_ids(last["completion_ids"])]
    )
    return ids
