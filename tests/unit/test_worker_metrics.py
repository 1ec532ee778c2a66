"""`/metrics` of a gateway with several processes: each process's counts added up, fleet facts once."""

from __future__ import annotations

import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.collector import FleetCollector
from gateway.fleet.servers import Server
from gateway.metrics import Metrics, exposition_with, samples


def scraped(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def worker(requests: int, in_flight: int, hit_rate: float, calls: list[tuple[str, int]]) -> Metrics:
    metrics = Metrics()
    server = Server(
        "http://vllm-a", requests=requests, in_flight=in_flight, pinned=4, prefix_cache_hit_rate=hit_rate
    )
    metrics.registry.register(FleetCollector(lambda: [server]))
    for endpoint, status in calls:
        metrics.call(endpoint, status, 0.02, prompt_tokens=10, completion_tokens=3)
    return metrics


def test_counts_of_every_worker_add_up_and_fleet_facts_are_not_multiplied():
    mine = worker(requests=3, in_flight=1, hit_rate=0.5, calls=[("chat", 200)] * 3)
    other = worker(requests=2, in_flight=2, hit_rate=0.5, calls=[("chat", 200), ("completions", 502)])

    # as the other process's heartbeat stored them (JSON in its row)
    merged = scraped(exposition_with(mine.registry, [orjson.loads(orjson.dumps(samples(other.registry)))]))

    backend = (("backend", "http://vllm-a"),)
    assert merged[("gateway_backend_requests_total", backend)] == 5
    assert merged[("gateway_backend_in_flight", backend)] == 3
    assert merged[("gateway_backend_healthy", backend)] == 1
    assert merged[("gateway_backend_pinned_rollouts", backend)] == 4  # the store's count, held by each
    assert merged[("gateway_backend_prefix_cache_hit_rate", backend)] == 0.5
    assert merged[("gateway_requests_total", (("endpoint", "chat"), ("status", "200")))] == 4
    assert merged[("gateway_requests_total", (("endpoint", "completions"), ("status", "502")))] == 1
    assert merged[("gateway_tokens_total", (("kind", "completion"),))] == 15
    assert merged[("gateway_request_latency_seconds_count", (("endpoint", "chat"),))] == 4
    assert merged[("gateway_request_latency_seconds_bucket", (("endpoint", "chat"), ("le", "0.025")))] == 4
    assert merged[("gateway_request_latency_seconds_count", (("endpoint", "completions"),))] == 1


def test_one_worker_alone_scrapes_as_without_workers():
    mine = worker(requests=3, in_flight=1, hit_rate=0.25, calls=[("chat", 200)])

    alone = scraped(exposition_with(mine.registry, []))

    assert alone[("gateway_requests_total", (("endpoint", "chat"), ("status", "200")))] == 1
    assert alone[("gateway_backend_prefix_cache_hit_rate", (("backend", "http://vllm-a"),))] == 0.25
