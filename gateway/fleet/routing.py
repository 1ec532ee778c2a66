"""Where a new rollout goes: the least-loaded healthy server that serves its model.

A rollout stays on the server it was first sent to (its prefix cache holds the rollout's history), so only
the choice of that server balances the fleet. Load is calls in flight, then rollouts pinned; ties go by a
hash of the rollout id, so that replicas choosing at the same moment from the same state spread alike.
Sticky assignment alone can pile hot rollouts onto one server; choosing by live load each time a rollout
starts keeps new work off the busy ones, and a bound keeps any server from holding more than its share of
the rollouts: a server already holding `LOAD_BOUND` times the mean number of pinned rollouts (counting the
new one) takes no new rollout while another is under it. Rollouts are never moved for load, only placed:
moving one costs its prefix cache.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

from gateway.fleet.servers import Server


def usable(server: Server, model: str | None) -> bool:
    """Can keep serving a rollout already pinned to it."""
    return server.healthy and server.serves(model)


def choose(servers: Iterable[Server], rollout_id: str, model: str | None) -> Server | None:
    """The server a new rollout is pinned to; None if no healthy server takes new rollouts for `model`."""
    candidates = [s for s in servers if usable(s, model) and not s.draining]
    if not candidates:
        return None
    bound = share_bound(sum(s.pinned for s in candidates) + 1, len(candidates))
    candidates = [s for s in candidates if s.pinned < bound] or candidates
    spread = zlib.crc32(rollout_id.encode())
    return min(
        candidates, key=lambda s: (s.in_flight, s.pinned, (zlib.crc32(s.url.encode()) ^ spread) & 0xFFFF)
    )


LOAD_BOUND = 1.25
"""How far above the mean a server's pinned rollouts may go (bounded-load placement)."""


def share_bound(rollouts: int, servers: int) -> int:
    """The most rollouts one of `servers` may hold when they hold `rollouts` between them."""
    return math.ceil(LOAD_BOUND * rollouts / servers)
