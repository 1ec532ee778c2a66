"""`/metrics` of a port served by several processes (`--workers`): each process's counts added up, the
leader's facts taken once."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.collector import LoadCollector, fleet_facts
from gateway.fleet.servers import Server
from gateway.metrics import Metrics, Samples, exposition_with, samples
from gateway.replicas.facts import NAMES, RunFacts
from gateway.store.backlog import Backlog

from support.fleets import fleet_of

FACTS = frozenset({"gateway_backend_healthy", "gateway_backend_pinned_rollouts", "gateway_paused"})


def scraped(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


class Facts:
    """The leader's facts, as `gateway.replicas.facts` exports them: only while it leads."""

    def __init__(self, server: Server, leads: bool) -> None:
        self.server, self.leads = server, leads

    def collect(self) -> Iterator[Metric]:
        if self.leads:
            yield GaugeMetricFamily("gateway_paused", "1 while agent calls are held.", value=0.0)
            yield from fleet_facts([self.server])


def worker(requests: int, in_flight: int, calls: list[tuple[str, int]], leads: bool = False) -> Metrics:
    metrics = Metrics()
    server = Server(
        "http://vllm-a", requests=requests, in_flight=in_flight, pinned=4, models=frozenset({"m"})
    )
    metrics.registry.register(LoadCollector(lambda: [server]))
    metrics.registry.register(Facts(server, leads))
    for endpoint, status in calls:
        metrics.call(endpoint, status, 0.02, prompt_tokens=10, completion_tokens=3)
    return metrics


def stored(metrics: Metrics) -> Samples:
    """Its samples as its heartbeat stores them (JSON in its row)."""
    read: Samples = orjson.loads(orjson.dumps(samples(metrics.registry)))
    return read


def test_counts_of_every_worker_add_up():
    mine = worker(requests=3, in_flight=1, calls=[("chat", 200)] * 3)
    other = worker(requests=2, in_flight=2, calls=[("chat", 200), ("completions", 502)])

    merged = scraped(exposition_with(mine.registry, [stored(other)], once=FACTS))

    backend = (("backend", "http://vllm-a"),)
    assert merged[("gateway_backend_requests_total", backend)] == 5
    assert merged[("gateway_backend_in_flight", backend)] == 3
    assert merged[("gateway_requests_total", (("endpoint", "chat"), ("status", "200")))] == 4
    assert merged[("gateway_requests_total", (("endpoint", "completions"), ("status", "502")))] == 1
    assert merged[("gateway_tokens_total", (("kind", "completion"),))] == 15
    assert merged[("gateway_request_latency_seconds_count", (("endpoint", "chat"),))] == 4
    assert merged[("gateway_request_latency_seconds_bucket", (("endpoint", "chat"), ("le", "0.025")))] == 4
    assert merged[("gateway_request_latency_seconds_count", (("endpoint", "completions"),))] == 1


def test_the_leaders_facts_reach_a_scrape_answered_by_another_worker_with_their_types_once():
    mine = worker(requests=3, in_flight=1, calls=[])
    leader = worker(requests=2, in_flight=2, calls=[], leads=True)

    text = exposition_with(mine.registry, [stored(leader)], once=FACTS)

    merged = scraped(text)
    backend = (("backend", "http://vllm-a"),)
    assert merged[("gateway_backend_healthy", backend)] == 1
    assert merged[("gateway_backend_pinned_rollouts", backend)] == 4
    assert merged[("gateway_model_backends_healthy", (("model", "m"),))] == 1
    assert merged[("gateway_paused", ())] == 0
    assert b"# TYPE gateway_backend_healthy gauge\n" in text


def test_facts_two_workers_hold_while_the_lead_passes_are_taken_from_one_not_added():
    mine = worker(requests=3, in_flight=1, calls=[], leads=True)
    former = worker(requests=2, in_flight=2, calls=[], leads=True)

    merged = scraped(exposition_with(mine.registry, [stored(former)], once=FACTS))

    assert merged[("gateway_backend_pinned_rollouts", (("backend", "http://vllm-a"),))] == 4
    assert merged[("gateway_backend_requests_total", (("backend", "http://vllm-a"),))] == 5


def test_one_worker_alone_scrapes_as_without_workers():
    mine = worker(requests=3, in_flight=1, calls=[("chat", 200)], leads=True)

    alone = scraped(exposition_with(mine.registry, [], once=FACTS))

    assert alone[("gateway_requests_total", (("endpoint", "chat"), ("status", "200")))] == 1
    assert alone[("gateway_backend_pinned_rollouts", (("backend", "http://vllm-a"),))] == 4


@pytest.mark.anyio
async def test_the_families_taken_from_one_worker_are_those_a_leading_process_exports():
    class Counted:
        async def backlog(self) -> Backlog:
            return Backlog(running=2, expired=1, unclaimed_groups=0)

    fleet = fleet_of(["http://vllm-a"], lora_bases={"agent": "m"})
    store: Any = Counted()
    traffic: Any = SimpleNamespace(paused=False)
    recorder: Any = SimpleNamespace(policy_version="0")
    facts = RunFacts(lambda: True, store, fleet, traffic, recorder)
    await facts.refresh()

    assert {family.name for family in facts.collect()} == NAMES
    assert len(NAMES) == 15
