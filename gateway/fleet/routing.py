"""Where a new rollout goes: where its group is, else the least-loaded healthy server that serves its model.

A rollout stays on the server it was first sent to (its prefix cache holds the rollout's history), so only
the choice of that server balances the fleet. Load is calls in flight, then rollouts pinned; ties go by a
hash of the rollout id, so that replicas choosing at the same moment from the same state spread alike.
Sticky assignment alone can pile hot rollouts onto one server; choosing by live load each time a rollout
starts keeps new work off the busy ones, and a bound keeps any server from holding more than its share of
the rollouts: a server already holding `LOAD_BOUND` times the mean number of pinned rollouts (counting the
new one) takes no new rollout while another is under it. Rollouts are never moved for load, only placed:
moving one costs its prefix cache.

The members of a GRPO group start from one prompt: each server that gets one computes that prompt again. So
a rollout whose siblings are placed goes to the server holding most of them while that server's load from
other groups stays under the bound, the next server holding some otherwise; only past the bound everywhere
does a group split onto a new server. The load counts a group declared with a size whole from its first
member (`gateway.store.pins.Loads`), so that servers balance by groups. Ties go by the group's id, so that
siblings placed at one moment agree.

A group's own members are bounded too, more loosely (`group_bound`): a server whose rollouts with the new
member (its group's own seats aside) would pass both `GROUP_BOUND` times the mean load and `GROUP_FLOOR`
takes no more of that group; the member goes to the next server of its group, else the least loaded. So a
large group (or an evaluation that gives every rollout one group id) spreads over as few servers as the bound
allows instead of piling onto one while the others idle, and a group of a few members stays whole however
idle the fleet. The mean counts the new member (and a declared group whole), so it is never zero.

A rollout that must move (its server failed, left or no longer serves its model) goes first to the server
holding the most of its history in its prefix cache (`gateway.fleet.prefixes`), while that server is under
the bound; else where its group is, as a new member would.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from enum import StrEnum

from gateway.fleet.servers import Server


def usable(server: Server, model: str | None) -> bool:
    """Can keep serving a rollout already pinned to it."""
    return server.healthy and server.serves(model)


class Reason(StrEnum):
    """Why a rollout was placed where it was (`gateway_placements_total{reason}`)."""

    GROUP = "group"
    """Beside its group's members."""
    SPLIT = "split"
    """Its group's servers held their share of other groups: the least loaded other server."""
    OVERFLOW = "overflow"
    """A server of its group held its group's bound (`group_bound`): the next server of its group, else the
    least loaded."""
    LOAD = "load"
    """No member of its group placed yet (or placement by load alone): the least loaded server."""
    HISTORY = "history"
    """A moving rollout: the server whose prefix cache holds the most of its history."""


def choose(servers: Iterable[Server], rollout_id: str, model: str | None) -> Server | None:
    """The server a new rollout is pinned to by load alone; None if no healthy server takes new rollouts
    for `model`."""
    placed = place(servers, rollout_id, model)
    return placed[0] if placed is not None else None


def place(
    servers: Iterable[Server],
    key: str,
    model: str | None,
    group: Mapping[str, int] | None = None,
    adds: int = 1,
    cached: Mapping[str, int] | None = None,
    seats: Mapping[str, int] | None = None,
) -> tuple[Server, Reason] | None:
    """The server for a new member of a group whose part of each server's load (`Server.pinned`) is
    `group`, and why; `adds`: the load placing it adds (a declared group's first member brings its siblings'
    seats; a member its group's home holds a seat for adds none); `cached`: for a moving rollout, the ids of
    its history each server holds; `seats`: the part of `group` that is seats its home holds for members
    still to come. Ties go by `key`."""
    candidates = [s for s in servers if usable(s, model) and not s.draining]
    if not candidates:
        return None
    rollouts = sum(s.pinned for s in candidates) + adds
    bound = share_bound(rollouts, len(candidates))
    if cached:
        holding = [s for s in candidates if cached.get(s.url) and s.pinned < bound]
        if holding:
            return min(holding, key=lambda s: (-cached[s.url], s.pinned, s.url)), Reason.HISTORY
    group, seats = group or {}, seats or {}
    crowded = group_bound(rollouts, len(candidates))
    homes = sorted((s for s in candidates if group.get(s.url)), key=lambda s: (-group[s.url], s.url))
    overflowed = False
    for home in homes:
        if home.pinned - group[home.url] >= bound:
            continue
        if home.pinned - seats.get(home.url, 0) + 1 > crowded:
            overflowed = True
            continue
        return home, Reason.OVERFLOW if overflowed else Reason.GROUP
    fitting = [s for s in candidates if s.pinned + max(adds, 1) <= bound]
    if not fitting:  # a group larger than any server's room: the least loaded take it
        lowest = min(s.pinned for s in candidates)
        fitting = [s for s in candidates if s.pinned == lowest]
    spread = zlib.crc32(key.encode())
    chosen = min(
        fitting, key=lambda s: (s.in_flight, s.pinned, (zlib.crc32(s.url.encode()) ^ spread) & 0xFFFF)
    )
    return chosen, Reason.OVERFLOW if overflowed else Reason.SPLIT if homes else Reason.LOAD


LOAD_BOUND = 1.25
"""How far above the mean a server's pinned rollouts may go (bounded-load placement)."""


def share_bound(rollouts: int, servers: int) -> int:
    """The most rollouts one of `servers` may hold when they hold `rollouts` between them."""
    return math.ceil(LOAD_BOUND * rollouts / servers)


GROUP_BOUND = 2.0
"""How far above the mean a server may go with members of one group: past it the group spreads."""

GROUP_FLOOR = 8
"""The rollouts a server may always hold with members of one group, however idle the fleet: a few members
cost a server hardly more than one (vLLM batches them), while each server a group spreads onto computes its
shared prompt again."""


def group_bound(rollouts: int, servers: int) -> int:
    """The most rollouts one of `servers` may hold with a new member of a group it holds, when they hold
    `rollouts` between them (the new member counted)."""
    return max(GROUP_FLOOR, math.ceil(GROUP_BOUND * rollouts / servers))
