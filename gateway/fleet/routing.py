"""Where a new rollout goes: the least-loaded healthy server that serves its model.

A rollout stays on the server it was first sent to (its prefix cache holds the rollout's history), so only
the choice of that server balances the fleet. Load is calls in flight, then rollouts pinned; ties go by a
hash of the rollout id, so that replicas choosing at the same moment from the same state spread alike.
Sticky assignment alone can pile hot rollouts onto one server; choosing by live load each time a rollout
starts keeps new work off the busy ones.
"""

from __future__ import annotations

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
    spread = zlib.crc32(rollout_id.encode())
    return min(
        candidates, key=lambda s: (s.in_flight, s.pinned, (zlib.crc32(s.url.encode()) ^ spread) & 0xFFFF)
    )
