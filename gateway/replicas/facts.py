"""What every process of the gateway knows alike, exported by the leading one alone: whether the run is
paused, the policy version served, the fleet's servers, rollouts running and expired, and groups waiting for
a trainer.
Each replica exporting them would make Prometheus add one fact up once per replica."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet.collector import FACT_NAMES, adapter_facts, fleet_facts
from gateway.fleet.fleet import Fleet
from gateway.store.backlog import Backlog
from gateway.store.store import Store
from gateway.turns.recording import Recorder
from gateway.turns.traffic import Traffic

REFRESH = 5.0
"""Seconds the store's counts are kept between heartbeats: they are aggregates, not a hot path."""


class RunFacts(Collector):
    def __init__(
        self,
        leads: Callable[[], bool],
        store: Store,
        fleet: Fleet,
        traffic: Traffic,
        recorder: Recorder,
    ) -> None:
        self._leads, self._store, self._fleet = leads, store, fleet
        self._traffic, self._recorder = traffic, recorder
        self._backlog: Backlog | None = None
        self._read_at = -REFRESH

    async def refresh(self, max_age: float = 0.0) -> None:
        """Read the store's counts again if this process leads and they are older than `max_age` seconds (a
        scrape reads them afresh; heartbeats, which carry them to a port's other workers, every `REFRESH`);
        a store out of reach leaves the last ones (readiness says why)."""
        if not self._leads() or time.monotonic() - self._read_at < max_age:
            return
        self._read_at = time.monotonic()
        try:
            self._backlog = await self._store.backlog()
        except Exception:  # the store's own errors: /readyz and the calls report them
            return

    def collect(self) -> Iterator[Metric]:
        if not self._leads():
            return
        yield from _run_facts(self._traffic.paused, self._recorder.policy_version, self._backlog)
        yield from fleet_facts(list(self._fleet.servers.values()))
        yield from adapter_facts(self._fleet.adapters, list(self._fleet.servers.values()))


def _run_facts(paused: bool, policy_version: str, backlog: Backlog | None) -> list[Metric]:
    """The run's own facts; the store's counts once read (`backlog`)."""
    facts: list[Metric] = [
        GaugeMetricFamily(
            "gateway_paused", "1 while agent calls are held (an admin pause).", value=float(paused)
        ),
        InfoMetricFamily(
            "gateway_policy_version",
            "The policy version the gateway stamps on new turns.",
            value={"policy_version": policy_version},
        ),
    ]
    if backlog is not None:
        facts += [
            GaugeMetricFamily("gateway_rollouts_running", "Rollouts running.", value=backlog.running),
            GaugeMetricFamily(
                "gateway_rollouts_expired",
                "Rollouts the gateway expired: no call or control request for --rollout-idle-timeout.",
                value=backlog.expired,
            ),
            GaugeMetricFamily(
                "gateway_groups_unclaimed",
                "Groups ready for training (every member finished) that no trainer has claimed: the "
                "trainers' backlog.",
                value=backlog.unclaimed_groups,
            ),
        ]
    return facts


NAMES = FACT_NAMES | {family.name for family in _run_facts(False, "", Backlog(0, 0, 0))}
"""The families only the leader exports: a scrape that merges a port's processes takes them from one."""
