"""The fleet's servers as Prometheus series, read when scraped: the fleet keeps the counts, so routing pays
nothing for them.

Two kinds: each process's own load on each server (its calls, errors and latency there), which a host's
processes add up; and the fleet's facts (health, draining, pins, prefix-cache hit ratio, servers per model),
which every process holds alike and the leading one alone exports (`gateway.replicas.facts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from gateway.fleet.adapters import FleetAdapters
from gateway.fleet.kv_events import KvEvents
from gateway.fleet.leaders import Leaders
from gateway.fleet.servers import Server

_BACKEND = ["backend"]


class LoadCollector(Collector):
    """This process's calls on each server (`backend` label)."""

    def __init__(self, servers: Callable[[], Iterable[Server]]) -> None:
        self._servers = servers

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "gateway_backend_in_flight", "Calls in progress on the server.", labels=_BACKEND
        )
        requests = CounterMetricFamily(
            "gateway_backend_requests", "Calls sent to the server.", labels=_BACKEND
        )
        errors = CounterMetricFamily(
            "gateway_backend_errors",
            "Calls that failed or that the server answered with a 5xx.",
            labels=_BACKEND,
        )
        latency = SummaryMetricFamily(
            "gateway_backend_latency_seconds",
            "Seconds from sending a call to its reply's headers.",
            labels=_BACKEND,
        )
        for server in self._servers():
            url = [server.url]
            in_flight.add_metric(url, server.in_flight)
            requests.add_metric(url, server.requests)
            errors.add_metric(url, server.errors)
            latency.add_metric(url, count_value=server.answered, sum_value=server.latency_total)
        yield from (in_flight, requests, errors, latency)


class LeaderCollector(Collector):
    """How often this process's group calls had their shared prompt computed once."""

    def __init__(self, leaders: Leaders) -> None:
        self._leaders = leaders

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "gateway_prompts_ahead",
            "Prompts a group's first call had its server compute ahead of it (a copy asking for one token).",
            value=self._leaders.led,
        )
        yield CounterMetricFamily(
            "gateway_calls_behind",
            "Calls that waited for their group's prompt, computed ahead by a sibling's call.",
            value=self._leaders.followed,
        )


class KvEventsCollector(Collector):
    """How this process reads each server's KV-cache events (`--kv-events`)."""

    def __init__(self, events: Callable[[], KvEvents | None]) -> None:
        self._events = events

    def collect(self) -> Iterator[Metric]:
        skipped = CounterMetricFamily(
            "gateway_kv_events_skipped",
            "What the server published that was skipped: a batch that is not vLLM's (what=batch), an event "
            "that is not well formed (what=event).",
            labels=["backend", "what"],
        )
        failures = CounterMetricFamily(
            "gateway_kv_events_failures",
            "Times reading the server's KV-cache events failed (then retried, the pause doubling to 60 s).",
            labels=_BACKEND,
        )
        down = GaugeMetricFamily(
            "gateway_kv_events_down",
            "1 while the process cannot read the server's KV-cache events: its index of the server's prefix "
            "cache is fed from the calls it sent there meanwhile.",
            labels=_BACKEND,
        )
        events = self._events()
        for url, reader in events.readers.items() if events is not None else ():
            for what, count in reader.skipped.items():
                skipped.add_metric([url, what], count)
            failures.add_metric([url], reader.failures)
            down.add_metric([url], float(reader.state == "down"))
        yield from (skipped, failures, down)


def fleet_facts(servers: Iterable[Server]) -> list[Metric]:
    """The servers' state as the run state holds it, and how many of each model's servers take calls."""
    healthy = GaugeMetricFamily("gateway_backend_healthy", "1 while the server takes calls.", labels=_BACKEND)
    draining = GaugeMetricFamily(
        "gateway_backend_draining", "1 while the server takes no new rollouts.", labels=_BACKEND
    )
    pinned = GaugeMetricFamily(
        "gateway_backend_pinned_rollouts", "Running rollouts pinned to the server.", labels=_BACKEND
    )
    hit_ratio = GaugeMetricFamily(
        "gateway_backend_prefix_cache_hit_ratio",
        "The server's own prefix-cache hits over queries since it started (from its /metrics).",
        labels=_BACKEND,
    )
    model_total = GaugeMetricFamily(
        "gateway_model_backends", "Servers that serve the model.", labels=["model"]
    )
    model_healthy = GaugeMetricFamily(
        "gateway_model_backends_healthy", "Servers that serve the model and take calls.", labels=["model"]
    )
    spans = GaugeMetricFamily(
        "gateway_backend_weight_spans",
        "1 while the server's replies carry each token's weight version (the project's vLLM plugin).",
        labels=_BACKEND,
    )
    adapter_errors = GaugeMetricFamily(
        "gateway_backend_adapter_errors",
        "LoRA versions the server failed to load: it takes none of their policy's calls until it loads them.",
        labels=_BACKEND,
    )
    models: dict[str, list[int]] = {}
    for server in servers:
        url = [server.url]
        healthy.add_metric(url, float(server.healthy))
        draining.add_metric(url, float(server.draining))
        pinned.add_metric(url, server.pinned)
        adapter_errors.add_metric(url, len(server.adapter_errors))
        if server.prefix_cache_hit_rate is not None:
            hit_ratio.add_metric(url, server.prefix_cache_hit_rate)
        if server.weight_spans is not None:
            spans.add_metric(url, float(server.weight_spans))
        for model in server.models:
            counts = models.setdefault(model, [0, 0])
            counts[0] += 1
            counts[1] += server.healthy
    for model, (total, up) in sorted(models.items()):
        model_total.add_metric([model], total)
        model_healthy.add_metric([model], up)
    return [healthy, draining, pinned, hit_ratio, spans, model_total, model_healthy, adapter_errors]


def adapter_facts(adapters: FleetAdapters, servers: Iterable[Server]) -> list[Metric]:
    """Each LoRA policy's live version, and the servers that serve it."""
    version = InfoMetricFamily(
        "gateway_lora_version", "The version a LoRA policy's new calls run on.", labels=["policy"]
    )
    serving = GaugeMetricFamily(
        "gateway_lora_backends_healthy",
        "Servers that hold a LoRA policy's live version and take calls.",
        labels=["policy"],
    )
    servers = list(servers)
    for policy in sorted(adapters.bases):
        live = adapters.live(policy)
        if live is None:
            continue
        version.add_metric([policy], {"version": live.version, "adapter": live.name})
        serving.add_metric([policy], sum(s.healthy and live.name in s.models for s in servers))
    return [version, serving]


FACT_NAMES = frozenset(family.name for family in (*fleet_facts(()), *adapter_facts(FleetAdapters(), ())))
"""The families of `fleet_facts` and `adapter_facts`, which make the same ones whatever the fleet holds: the
leader's to export (`gateway.replicas.facts`)."""
