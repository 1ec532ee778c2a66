"""Prometheus metrics of the gateway, one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
