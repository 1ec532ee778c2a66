"""A rollout its environment never finishes is expired after --rollout-idle-timeout, as the control API,
the agent, the metrics and `trainer-client stats` see it. The sweep is run directly with a `now` past the
limit, except where the setting's own sweep is what is shown."""

from __future__ import annotations

import json
import time

import pytest

from gateway.replicas.expiry import sweep
from trainer_client.cli import main as trainer_client_cli

import support
from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio


async def played(gw, rollout_id: str) -> None:
    """Created, and one answered model call."""
    created = await gw.client.post("/rollouts", json={"rollout_id": rollout_id})
    assert created.status_code == 201, created.text
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8], "ok"))
    assert (await gw.chat(rollout_id)).status_code == 200


async def expire(gw) -> list[str]:
    """The leading process's sweep, an hour past a minute's idle limit."""
    control = gw.app.state.control
    return await sweep(control.store, control.fleet, 60.0, now=time.time() + 3600.0)


async def test_an_expired_rollout_shows_its_status_and_refuses_a_late_call_without_calling_the_engine(gw):
    await played(gw, "r")
    assert await expire(gw) == ["r"]
    calls = len(gw.engine.requests)

    late = await gw.chat("r")
    shown = await gw.rollout("r")

    error = support.assert_openai_error(late, 409, "rollout_expired")
    assert "--rollout-idle-timeout" in error["message"]
    assert len(gw.engine.requests) == calls
    assert (shown["status"], len(shown["turns"])) == ("expired", 1)
    assert shown["finished_at"] is not None


async def test_a_late_finish_is_refused_and_stores_nothing_while_a_reward_is_kept_as_for_any_ended_rollout(
    gw,
):
    await played(gw, "r")
    await expire(gw)

    finish = await gw.client.post("/rollouts/r/finish", json={"status": "completed", "reward": 1.0})
    after_finish = await gw.rollout("r")
    reward = await gw.client.post("/rollouts/r/reward", json={"reward": 0.5})
    after_reward = await gw.rollout("r")

    support.assert_openai_error(finish, 409, "rollout_expired")
    assert (after_finish["status"], after_finish["reward"], after_finish["rewards"]) == ("expired", None, [])
    assert reward.status_code == 200, reward.text
    assert (after_reward["status"], after_reward["reward"]) == ("expired", 0.5)


async def test_metrics_count_expired_rollouts_apart_from_the_running_ones(gw):
    for rollout_id in ("a", "b"):
        await played(gw, rollout_id)
    before = support.scraped((await gw.client.get("/metrics")).text)
    await expire(gw)
    await gw.client.post("/rollouts", json={"rollout_id": "next"})
    after = support.scraped((await gw.client.get("/metrics")).text)

    gauges = ("gateway_rollouts_running", "gateway_rollouts_expired")
    assert [before[name] for name in gauges] == [2, 0]
    assert [after[name] for name in gauges] == [1, 2]


async def test_stats_count_expired_rollouts_by_their_status(gw, capsys):
    for rollout_id in ("a", "b"):
        await played(gw, rollout_id)
    assert (await gw.client.post("/rollouts/a/finish", json={"reward": 1.0})).status_code == 200
    await expire(gw)

    assert trainer_client_cli(["stats", "--db", gw.db, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["rollouts"] == [
        {"status": "completed", "rollouts": 1},
        {"status": "expired", "rollouts": 1},
    ]


async def test_the_gateway_expires_an_idle_rollout_by_itself_after_its_idle_timeout(start):
    gw = await start(rollout_idle_timeout=0.05)
    await played(gw, "r")

    await support.until(lambda: status_is(gw, "r", "expired"), "the rollout expired")


async def status_is(gw, rollout_id: str, status: str) -> bool:
    return (await gw.rollout(rollout_id))["status"] == status


async def test_the_viewer_lists_an_expired_rollout_by_its_status_and_shows_it_failed_in_its_group(gw):
    for rollout_id in ("a", "b", "crashed"):
        created = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, "group_id": "g"})
        assert created.status_code == 201, created.text
    for rollout_id, reward in (("a", 1.0), ("b", 0.0)):
        gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8], "ok"))
        assert (await gw.chat(rollout_id)).status_code == 200
        assert (
            await gw.client.post(f"/rollouts/{rollout_id}/finish", json={"reward": reward})
        ).status_code == 200
    await expire(gw)

    listed = (await gw.client.get("/ui/api/rollouts", params={"status": "expired"})).json()["rollouts"]
    group = (await gw.client.get("/ui/api/groups/g")).json()

    assert [row["rollout_id"] for row in listed] == ["crashed"]
    assert [(row["rollout_id"], row["status"], row["skip_reason"]) for row in group["rollouts"]] == [
        ("a", "completed", None),
        ("b", "completed", None),
        ("crashed", "expired", "failed"),
    ]
    assert group["trained"] == 2
