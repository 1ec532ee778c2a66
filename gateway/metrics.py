"""Prometheus metrics of the gateway, one registry per app."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.samples import Sample


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gateway_requests",
            "Agent model calls by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "gateway_request_latency_seconds",
            "Agent model call latency, end to end.",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens recorded, by kind (prompt, completion).",
            ["kind"],
            registry=self.registry,
        )
        self.errors = Counter(
            "gateway_errors", "Failed agent model calls by reason.", ["reason"], registry=self.registry
        )
        self.in_flight = Gauge("gateway_in_flight", "Agent model calls in progress.", registry=self.registry)
        self.commits = Gauge(
            "gateway_store_commits",
            "Store transactions committed (turns share them).",
            registry=self.registry,
        )
        stages = Histogram(
            "gateway_stage_seconds",
            "Seconds an agent call spends in each stage: admission (its arrival to its departure: the "
            "rollout's state, the body read and checked, a pause), queue (waiting for a backend connection), "
            "render (exact mode's prompt, a context limit's count), upstream (sent, queue included, to the "
            "first token or the whole reply), relay (first token to last), commit (the store transaction).",
            ["stage"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 300),
            registry=self.registry,
        )
        self.stage = {name: stages.labels(stage=name) for name in STAGES}
        """Each stage's histogram, looked up once."""
        self.relayed = Counter(
            "gateway_relayed_tokens",
            "Sampled tokens streamed to agents, counted as they pass.",
            registry=self.registry,
        )
        self.queued = Gauge(
            "gateway_calls_queued", "Agent calls waiting for a backend connection.", registry=self.registry
        )
        self.loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LAG_INTERVAL:g} s: how long work that is ready "
            "waits for the loop (every call's every step does).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self._children: dict[tuple[str, int], tuple[Counter, Histogram, Counter, Counter]] = {}

    def call(
        self, endpoint: str, status: int, seconds: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Count one agent call. The children of each label set are looked up once: `labels()` cost more than
        the counting itself."""
        children = self._children.get((endpoint, status))
        if children is None:
            children = self._children[endpoint, status] = (
                self.requests.labels(endpoint=endpoint, status=str(status)),
                self.latency.labels(endpoint=endpoint),
                self.tokens.labels(kind="prompt"),
                self.tokens.labels(kind="completion"),
            )
        requests, latency, prompt, completion = children
        requests.inc()
        latency.observe(seconds)
        prompt.inc(prompt_tokens)
        completion.inc(completion_tokens)

    async def watch_loop(self) -> None:
        """Measure the event loop's lag until cancelled: a timer's lateness is what any ready task waits."""
        while True:
            due = time.perf_counter() + LAG_INTERVAL
            await asyncio.sleep(LAG_INTERVAL)
            self.loop_lag.observe(max(0.0, time.perf_counter() - due))


STAGES = ("admission", "queue", "render", "upstream", "relay", "commit")
LAG_INTERVAL = 0.25
"""Seconds between two measures of the event loop's lag."""

Samples = dict[str, list[tuple[str, dict[str, str], float]]]
"""A registry's samples by metric family: (sample name, labels, value)."""

_FLEET_FACTS = (
    "gateway_backend_healthy",
    "gateway_backend_draining",
    "gateway_backend_pinned_rollouts",
    "gateway_backend_prefix_cache_hit_rate",
)
"""Gauges every gateway process holds alike (rollouts pinned are the store's count): taken from one, not added
up."""


def samples(registry: CollectorRegistry) -> Samples:
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples] for family in registry.collect()
    }


def exposition_with(registry: CollectorRegistry, others: list[Samples]) -> bytes:
    """This process's metrics in Prometheus text with the other gateway processes' added: counts, sums, calls
    in flight and pinned rollouts add up; the servers' facts and creation times are this process's."""
    families = []
    for family in registry.collect():
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {
            (s.name, tuple(sorted(s.labels.items()))): s for s in family.samples
        }
        if family.name not in _FLEET_FACTS:
            for other in others:
                for name, labels, value in other.get(family.name, ()):
                    key = (name, tuple(sorted(labels.items())))
                    mine = merged.get(key)
                    if mine is None:
                        merged[key] = Sample(name, labels, value)
                    elif not name.endswith("_created"):
                        merged[key] = mine._replace(value=mine.value + value)
        family.samples = list(merged.values())
        families.append(family)
    return generate_latest(_Collected(families))


class _Collected:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
