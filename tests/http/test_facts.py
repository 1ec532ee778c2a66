"""The run's gauges in `/metrics`, as an operator's dashboard reads them: paused or not, the policy version
served, rollouts running, groups ready that no trainer has claimed, servers per model and how many take
calls."""

from __future__ import annotations

import pytest

from trainer_client import TrainerClient

import support
from support.fake_engine import URL, chat_reply

pytestmark = pytest.mark.anyio

RUN = (
    "gateway_paused",
    "gateway_rollouts_running",
    "gateway_groups_unclaimed",
    'gateway_policy_version_info{policy_version="0"}',
    'gateway_policy_version_info{policy_version="7"}',
)


async def scrape(gw) -> dict[str, float]:
    return support.scraped((await gw.client.get("/metrics")).text)


async def run_gauges(gw) -> dict[str, float]:
    scraped = await scrape(gw)
    return {name: scraped[name] for name in RUN if name in scraped}


async def play(gw, rollout_id: str, group_id: str) -> None:
    created = await gw.client.post(
        "/rollouts", json={"rollout_id": rollout_id, "group_id": group_id, "group_size": 2}
    )
    assert created.status_code == 201, created.text
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [3], "ok"))
    assert (await gw.chat(rollout_id)).status_code == 200


async def finish(gw, rollout_id: str) -> None:
    finished = await gw.client.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0})
    assert finished.status_code == 200, finished.text


async def test_rollouts_running_and_groups_waiting_for_a_trainer_follow_the_run(gw):
    for rollout_id, group_id in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        await play(gw, rollout_id, group_id)
    running = await run_gauges(gw)

    for rollout_id in ("a1", "a2", "b1"):
        await finish(gw, rollout_id)
    one_group_ready = await run_gauges(gw)  # b waits for its second member

    client = TrainerClient(gw.db)
    claimed = client.claim("trainer-0", 0)
    client.close()
    after_the_claim = await run_gauges(gw)

    base = {'gateway_policy_version_info{policy_version="0"}': 1.0, "gateway_paused": 0.0}
    assert running == base | {"gateway_rollouts_running": 3, "gateway_groups_unclaimed": 0}
    assert one_group_ready == base | {"gateway_rollouts_running": 0, "gateway_groups_unclaimed": 1}
    assert sorted(sample.rollout_id for sample in claimed.samples) == ["a1", "a2"]
    assert after_the_claim == base | {"gateway_rollouts_running": 0, "gateway_groups_unclaimed": 0}


async def test_a_pause_and_a_new_policy_version_show_at_once(gw):
    paused = await gw.client.post("/admin/pause")
    assert paused.status_code == 200, paused.text
    during = await run_gauges(gw)
    assert (await gw.client.post("/admin/policy_version", json={"version": "7"})).status_code == 200
    assert (await gw.client.post("/admin/resume")).status_code == 200

    after = await run_gauges(gw)

    counts = {"gateway_rollouts_running": 0, "gateway_groups_unclaimed": 0}
    assert during == counts | {'gateway_policy_version_info{policy_version="0"}': 1.0, "gateway_paused": 1.0}
    assert after == counts | {'gateway_policy_version_info{policy_version="7"}': 1.0, "gateway_paused": 0.0}


async def test_servers_per_model_count_those_that_take_calls(gw):
    gw.engine.servers[URL].models = frozenset({"tiny"})
    healthy = await scrape(gw)
    gw.engine.servers[URL].healthy = False

    ejected = await scrape(gw)

    per_model = ('gateway_model_backends{model="tiny"}', 'gateway_model_backends_healthy{model="tiny"}')
    assert [healthy[name] for name in per_model] == [1, 1]
    assert [ejected[name] for name in per_model] == [1, 0]
    assert ejected[f'gateway_backend_healthy{{backend="{URL}"}}'] == 0
