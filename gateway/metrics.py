"""Prometheus metrics of the gateway, one registry per app.

A scrape of a host's port reports that port's processes (`gateway serve --workers N`: each worker's samples
reach the others through the store) and never another host's, so that Prometheus adds hosts up without
counting anything twice; what every process knows alike (the run state, the fleet, the store's counts) is
exported by the leading process alone (`gateway.replicas.facts`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class Metrics:
    def __init__(self, commits: Callable[[], int] = lambda: 0) -> None:
        """`commits` reads the store's count of committed transactions."""
        self.registry = CollectorRegistry()
        self.registry.register(
            Count("gateway_store_commits", "Store transactions committed (turns share them).", commits)
        )
        self.requests, self.latency, self.tokens, self.errors, self.in_flight = _call_metrics(self.registry)
        self.stage = _stage_metrics(self.registry)
        """Each stage's histogram, looked up once."""
        self.relayed, self.placements, self.queued = _backend_metrics(self.registry)
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


def _call_metrics(registry: CollectorRegistry) -> tuple[Counter, Histogram, Counter, Counter, Gauge]:
    """What each agent call counts as it ends (`Metrics.call`), and the calls not ended yet."""
    requests = Counter(
        "gateway_requests",
        "Agent model calls by endpoint and HTTP status.",
        ["endpoint", "status"],
        registry=registry,
    )
    latency = Histogram(
        "gateway_request_latency_seconds",
        "Agent model call latency, end to end.",
        ["endpoint"],
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        registry=registry,
    )
    tokens = Counter(
        "gateway_tokens",
        "Tokens recorded, by kind (prompt, completion).",
        ["kind"],
        registry=registry,
    )
    errors = Counter("gateway_errors", "Failed agent model calls by reason.", ["reason"], registry=registry)
    in_flight = Gauge("gateway_calls_in_flight", "Agent model calls in progress.", registry=registry)
    return requests, latency, tokens, errors, in_flight


def _stage_metrics(registry: CollectorRegistry) -> dict[str, Histogram]:
    """Where an agent call's time goes: each stage one child of one histogram, so that a call's stages are
    compared and summed across one family."""
    stages = Histogram(
        "gateway_stage_seconds",
        "Seconds an agent call spends in each stage: admission (its arrival to its departure: the "
        "rollout's state, the body read and checked, a pause), queue (waiting for a backend connection, "
        "or for the prompt a group's first call computes), render (exact mode's prompt, a context "
        "limit's count), upstream (sent, queue included, to the first token or the whole reply), relay "
        "(first token to last), commit (the store transaction).",
        ["stage"],
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 300),
        registry=registry,
    )
    return {name: stages.labels(stage=name) for name in STAGES}


def _backend_metrics(registry: CollectorRegistry) -> tuple[Counter, Counter, Gauge]:
    """What passes between the agents and the vLLM servers: the tokens relayed, where rollouts are pinned
    and the calls waiting for a server."""
    relayed = Counter(
        "gateway_relayed_tokens",
        "Sampled tokens streamed to agents, counted as they pass.",
        registry=registry,
    )
    placements = Counter(
        "gateway_placements",
        "Rollouts this process pinned to a server, by why it chose that one: group (beside its group's "
        "members), split (its group's servers held their share of other groups), overflow (a server of "
        "its group held its group's bound, twice the mean load and at least 8: the next server of its "
        "group, else the least loaded), load (the least loaded server: the first of its group, or "
        "--placement load), history (a rollout that moved: the server holding the most of its history).",
        ["reason"],
        registry=registry,
    )
    queued = Gauge(
        "gateway_calls_queued",
        "Agent calls waiting for a backend connection, or for the prompt their group's first call computes.",
        registry=registry,
    )
    return relayed, placements, queued


Samples = dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]]
"""A registry's metric families by name: (type, help, samples as (sample name, labels, value))."""


class Count(Collector):
    """A count kept elsewhere as a plain integer, exported as a counter: the hot path increments one number,
    not two."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


def samples(registry: CollectorRegistry) -> Samples:
    return {
        family.name: (
            family.type,
            family.documentation,
            [(s.name, s.labels, s.value) for s in family.samples],
        )
        for family in registry.collect()
    }


def exposition_with(registry: CollectorRegistry, others: list[Samples], once: Collection[str] = ()) -> bytes:
    """This process's metrics in Prometheus text with other processes' of the same port added: counts, sums
    and calls in flight add up, creation times are this process's, and the families in `once` (the leader's
    facts) are taken from the first process that has them, never added."""
    families, given = [], {family.name: family for family in registry.collect()}
    for other in others:  # a family only another process exports: the leader's facts
        for name in other.keys() - given.keys():
            kind, documentation, _ = other[name]
            given[name] = Metric(name, documentation, kind)
    for family in given.values():
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {
            (s.name, tuple(sorted(s.labels.items()))): s for s in family.samples
        }
        for other in others:
            if family.name in once and merged:
                break
            for name, labels, value in other[family.name][2] if family.name in other else ():
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
