"""`/metrics` as Prometheus scrapes a gateway of several replicas on one PostgreSQL: each port reports its own
processes' calls (its `--workers` added up) and never another's, and what every process knows alike (the
pause, the policy version, rollouts running, the fleet) comes from the leader alone. Summed over the
scraped ports, every count is counted once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from rollout_store.database import ensure_schema

import support
from support.fake_engine import FakeEngine, chat_reply

pytestmark = pytest.mark.anyio

CHAT = 'gateway_requests_total{endpoint="chat",status="200"}'


class Replica:
    def __init__(self, client: httpx.AsyncClient, engine: FakeEngine) -> None:
        self.client, self.engine = client, engine

    async def scrape(self) -> dict[str, float]:
        return support.scraped((await self.client.get("/metrics")).text)

    async def calls(self, count: int) -> None:
        for i in range(count):
            self.engine.answer("/v1/chat/completions", chat_reply([1, 2], [3], "ok"))
            answer = await self.client.post(
                f"/rollouts/r{i}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert answer.status_code == 200, answer.text


@pytest.fixture
def replicas(databases: Any, start: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Replica]]:
    """`await replicas(port=...)`: a gateway process (in process) on one shared PostgreSQL store."""
    db = databases.new("postgresql")
    ensure_schema(db)

    async def started(**settings: Any) -> Replica:
        gateway = await start(db=db, heartbeat_interval=0.1, **settings)
        return Replica(gateway.client, gateway.engine)

    return started


async def test_replicas_on_other_ports_each_report_their_own_calls_and_the_leaders_facts_once(replicas):
    a, b = await replicas(port=8101), await replicas(port=8102)
    await a.calls(10)

    async def one_reports_ten_running() -> bool:
        return [(await r.scrape()).get("gateway_rollouts_running") for r in (a, b)] in (
            [10, None],
            [None, 10],
        )

    await support.until(one_reports_ten_running, "the leader's count of the rollouts running")
    scraped = [await a.scrape(), await b.scrape()]

    assert [s.get(CHAT, 0) for s in scraped] == [10, 0]
    assert [s.get('gateway_tokens_total{kind="completion"}', 0) for s in scraped] == [10, 0]
    assert sorted(s.get("gateway_paused", -1) for s in scraped) == [-1, 0]
    assert sorted(s.get('gateway_policy_version_info{policy_version="0"}', 0) for s in scraped) == [0, 1]
    assert sorted(s.get('gateway_backend_healthy{backend="http://fake-engine"}', 0) for s in scraped) == [
        0,
        1,
    ]


async def test_the_workers_of_one_port_add_up_their_calls_and_each_scrape_holds_the_leaders_facts_once(
    replicas,
):
    a, b = await replicas(port=8100, workers=2), await replicas(port=8100, workers=2)
    await a.calls(10)

    async def both_count_everything() -> bool:
        scraped = [await a.scrape(), await b.scrape()]
        return all(s.get(CHAT) == 10 and s.get("gateway_rollouts_running") == 10 for s in scraped)

    await support.until(both_count_everything, "each worker's scrape to add up the port's calls")
    scraped = [await a.scrape(), await b.scrape()]

    for s in scraped:
        assert s['gateway_tokens_total{kind="completion"}'] == 10
        assert s["gateway_paused"] == 0
        assert s['gateway_policy_version_info{policy_version="0"}'] == 1
        assert s['gateway_backend_healthy{backend="http://fake-engine"}'] == 1
        assert s["gateway_groups_unclaimed"] == 0
