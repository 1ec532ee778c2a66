"""The leading process expires the rollouts nobody finishes (`gateway.store.expiry`), once a sweep interval:
the expiry is safe from every process, one doing it is enough."""

from __future__ import annotations

import asyncio
import logging

from gateway.fleet.fleet import Fleet
from gateway.replicas.replica import Replica
from gateway.store.store import Store

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 60.0
"""Seconds between sweeps (at most; a shorter idle limit is swept as often as it lasts): a rollout is expired
within that much past its limit."""


async def expiring(replica: Replica, store: Store, fleet: Fleet, idle: float) -> None:
    """Each sweep interval, while this process leads: expire the rollouts idle for `idle` seconds."""
    while True:
        await asyncio.sleep(min(SWEEP_INTERVAL, idle))
        if not replica.leads:
            continue
        try:
            await sweep(store, fleet, idle)
        except Exception as exc:  # the store failed this round: the next one tries again
            log.warning("expiring idle rollouts failed: %r", exc)


async def sweep(store: Store, fleet: Fleet, idle: float, now: float | None = None) -> list[str]:
    """Expire the rollouts idle for `idle` seconds before `now`; this process's servers stop counting them
    at once, as for a finish (the other processes take the store's counts at their next heartbeat)."""
    expired = await store.expire_idle(idle, now)
    for rollout_id in expired:
        fleet.forget(rollout_id)
    if expired:
        log.info(
            "expired %d rollouts with no call or control request for %.0f s: %s",
            len(expired),
            idle,
            ", ".join(expired[:10]) + (", ..." if len(expired) > 10 else ""),
        )
    return expired
