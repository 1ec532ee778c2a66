"""Groups with a declared size (`POST /rollouts {"group_size": N}`): served to trainers only once that many
members have finished, whatever order an environment runs them in; members that would change a group a
trainer may have taken are refused with 409."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from trainer_client import SampleOptions, TrainerClient
from trainer_client.cli import main as trainer_client_cli

from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio


async def create(gw, rollout_id: str, **fields: object) -> dict:
    answer = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, **fields})
    assert answer.status_code == 201, answer.text
    return answer.json()


async def play(gw, rollout_id: str, reward: float) -> None:
    """One answered model call, then the rollout finished with `reward`."""
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8], "ok"))
    assert (await gw.chat(rollout_id)).status_code == 200
    finished = await gw.client.post(f"/rollouts/{rollout_id}/finish", json={"reward": reward})
    assert finished.status_code == 200, finished.text


async def refused(gw, rollout_id: str, **fields: object) -> dict:
    answer = await gw.client.post("/rollouts", json={"rollout_id": rollout_id, **fields})
    assert answer.status_code == 409, answer.text
    return answer.json()["error"]


def advantages(batch) -> dict[str, float]:
    return {sample.rollout_id: round(sample.advantage, 3) for sample in batch.samples}


async def test_a_group_run_two_members_at_a_time_trains_only_whole_with_the_advantages_the_store_shows(gw):
    """The environment of a bounded-concurrency orchestrator: a group of 4, two members running at a time."""
    client = TrainerClient(gw.db)
    for rollout_id in ("r1", "r2"):
        await create(gw, rollout_id, group_id="g", group_size=4)
    await asyncio.gather(play(gw, "r1", 1.0), play(gw, "r2", 1.0))

    first = client.claim("trainer-0", 0)

    for rollout_id in ("r3", "r4"):
        await create(gw, rollout_id, group_id="g", group_size=4)
    await asyncio.gather(play(gw, "r3", 1.0), play(gw, "r4", 0.5))
    second = client.claim("trainer-0", 1)
    stored = client.read_groups(["g"])
    client.close()

    assert (first.samples, first.counts["groups"]) == ([], 0)
    assert advantages(second) == {"r1": 0.577, "r2": 0.577, "r3": 0.577, "r4": -1.732}
    assert advantages(stored) == advantages(second)


async def test_a_member_that_declares_no_size_joins_with_its_groups_size(gw):
    await create(gw, "a", group_id="g", group_size=2)

    joined = await create(gw, "b", group_id="g")

    assert joined["group_size"] == 2
    assert (await gw.rollout("b"))["group_size"] == 2


async def test_a_member_that_declares_another_size_is_refused(gw):
    await create(gw, "a", group_id="g", group_size=4)

    error = await refused(gw, "b", group_id="g", group_size=3)

    assert (error["code"], error["message"]) == (
        "group_size_conflict",
        "group 'g' was declared with 4 members: a member cannot declare 3",
    )


async def test_a_size_declared_for_a_group_created_without_one_is_refused(gw):
    await create(gw, "a", group_id="g")

    error = await refused(gw, "b", group_id="g", group_size=2)

    assert error["message"] == "group 'g' was created without a group_size: a member cannot declare 2"


async def test_a_member_past_the_declared_size_is_refused(gw):
    await create(gw, "a", group_id="g", group_size=2)
    await create(gw, "b", group_id="g", group_size=2)

    error = await refused(gw, "c", group_id="g")

    assert (error["code"], error["message"]) == ("group_full", "group 'g' has its 2 members already")


async def test_a_member_created_after_a_trainer_took_its_group_is_refused(gw):
    await create(gw, "a", group_id="g")
    await play(gw, "a", 1.0)
    with TrainerClient(gw.db) as client:
        assert len(client.claim("trainer-0", 0).samples) == 1

    error = await refused(gw, "b", group_id="g")

    assert (error["code"], error["message"]) == (
        "group_claimed",
        "group 'g' was taken by a trainer already: a new member would not train with it",
    )


async def test_a_refused_member_leaves_nothing_stored(gw):
    await create(gw, "a", group_id="g", group_size=1)

    await refused(gw, "b", group_id="g")

    assert (await gw.client.get("/rollouts/b")).status_code == 404


async def test_members_created_at_once_past_the_size_are_refused_all_but_the_size(gw):
    answers = await asyncio.gather(
        *(gw.client.post("/rollouts", json={"group_id": "g", "group_size": 4}) for _ in range(7))
    )

    assert sorted(answer.status_code for answer in answers) == [201] * 4 + [409] * 3


async def test_creating_a_member_again_with_its_size_is_idempotent_and_with_another_a_conflict(gw):
    await create(gw, "a", group_id="g", group_size=2)

    again = await gw.client.post("/rollouts", json={"rollout_id": "a", "group_id": "g", "group_size": 2})
    other = await gw.client.post("/rollouts", json={"rollout_id": "a", "group_size": 3})

    assert (again.status_code, again.json()["group_size"]) == (200, 2)
    assert (other.status_code, other.json()["error"]["code"]) == (409, "rollout_conflict")


@pytest.mark.parametrize("size", [0, -1, 65537, "4", 2.0, True])
async def test_a_group_size_that_is_not_a_positive_integer_is_a_422(gw, size):
    answer = await gw.client.post("/rollouts", json={"group_id": "g", "group_size": size})

    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == "group_size"


async def test_a_trainers_group_timeout_serves_a_declared_group_with_the_members_it_has(gw):
    for rollout_id in ("a", "b"):
        await create(gw, rollout_id, group_id="g", group_size=4)
    await play(gw, "a", 1.0)
    await play(gw, "b", 0.0)

    with TrainerClient(gw.db) as client:
        waiting = client.claim("trainer-0", 0)
        late = client.claim("trainer-0", 1, SampleOptions(group_timeout=0.0))

    assert waiting.samples == []
    assert advantages(late) == {"a": 1.0, "b": -1.0}


async def test_stats_list_a_declared_group_still_waiting_with_its_counts(gw, capsys):
    for rollout_id in ("a", "b"):
        await create(gw, rollout_id, group_id="g", group_size=4)
    await play(gw, "a", 1.0)
    await create(gw, "c", group_id="h", group_size=1)
    await play(gw, "c", 1.0)

    assert trainer_client_cli(["stats", "--db", gw.db, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    (waiting,) = report["waiting_groups"]
    age = waiting.pop("age_s")
    assert waiting == {"group_id": "g", "group_size": 4, "created": 2, "finished": 1}
    assert 0 <= age < 600 and not math.isnan(age)
    assert report["groups"] == [{"groups": 2, "complete": 1, "waiting": 1}]


async def test_stats_list_every_group_they_count_as_waiting_declared_or_not(gw, capsys):
    await create(gw, "a", group_id="declared", group_size=2)
    await play(gw, "a", 1.0)
    await create(gw, "b", group_id="undeclared")
    await create(gw, "c", group_id="done")
    await play(gw, "c", 1.0)

    assert trainer_client_cli(["stats", "--db", gw.db, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    waiting = [{k: v for k, v in group.items() if k != "age_s"} for group in report["waiting_groups"]]
    assert waiting == [
        {"group_id": "declared", "group_size": 2, "created": 1, "finished": 1},
        {"group_id": "undeclared", "group_size": None, "created": 1, "finished": 0},
    ]
    assert report["groups"] == [{"groups": 3, "complete": 1, "waiting": 2}]


async def test_a_rollout_reports_the_mode_it_runs_in(gw):
    created = await create(gw, "a")

    shown = await gw.rollout("a")

    assert created["mode"] == shown["mode"] == "passthrough"
