"""The fleet's servers as Prometheus series, read when scraped: the pool keeps the counts, so routing pays
nothing for them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from gateway.fleet.servers import Server


class FleetCollector(Collector):
    """The fleet as this process sees it, one series per server (`backend` label)."""

    def __init__(self, servers: Callable[[], Iterable[Server]]) -> None:
        self._servers = servers

    def collect(self) -> Iterator[Metric]:
        label = ["backend"]
        healthy = GaugeMetricFamily(
            "gateway_backend_healthy", "1 while the server takes calls.", labels=label
        )
        draining = GaugeMetricFamily(
            "gateway_backend_draining", "1 while the server takes no new rollouts.", labels=label
        )
        in_flight = GaugeMetricFamily(
            "gateway_backend_in_flight", "Calls in progress on the server.", labels=label
        )
        pinned = GaugeMetricFamily(
            "gateway_backend_pinned_rollouts", "Running rollouts pinned to the server.", labels=label
        )
        requests = CounterMetricFamily("gateway_backend_requests", "Calls sent to the server.", labels=label)
        errors = CounterMetricFamily(
            "gateway_backend_errors",
            "Calls that failed or that the server answered with a 5xx.",
            labels=label,
        )
        latency = SummaryMetricFamily(
            "gateway_backend_latency_seconds",
            "Seconds from sending a call to its reply's headers.",
            labels=label,
        )
        hit_rate = GaugeMetricFamily(
            "gateway_backend_prefix_cache_hit_rate",
            "The server's own prefix-cache hits over queries since it started (from its /metrics).",
            labels=label,
        )
        for server in self._servers():
            url = [server.url]
            healthy.add_metric(url, float(server.healthy))
            draining.add_metric(url, float(server.draining))
            in_flight.add_metric(url, server.in_flight)
            pinned.add_metric(url, server.pinned)
            requests.add_metric(url, server.requests)
            errors.add_metric(url, server.errors)
            latency.add_metric(url, count_value=server.answered, sum_value=server.latency_total)
            if server.prefix_cache_hit_rate is not None:
                hit_rate.add_metric(url, server.prefix_cache_hit_rate)
        yield from (healthy, draining, in_flight, pinned, requests, errors, latency, hit_rate)
