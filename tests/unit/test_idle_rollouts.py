"""Rollouts nobody finishes are expired after the idle limit, on SQLite and PostgreSQL alike: out of their
server's load and of the rollouts running, their group served with them as failed members. The sweep is
given its `now`: no test waits for the limit to pass."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np
import pytest

from gateway.replicas.expiry import sweep
from gateway.store.records import NewRollout, Reward, StoreError, TurnRecord
from gateway.store.store import Store
from trainer_client import TrainerClient

from support.fleets import fleet_of

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def turn(rollout_id: str, finished_at: float) -> TurnRecord:
    return TurnRecord(
        rollout_id=rollout_id,
        endpoint="chat",
        model=None,
        stream=False,
        policy_version="0",
        started_at=finished_at - 1.0,
        finished_at=finished_at,
        prompt_ids=np.arange(1, 4, dtype=np.int32),
        completion_ids=np.arange(7, 9, dtype=np.int32),
    )


async def statuses(store: Store, *rollout_ids: str) -> dict[str, str]:
    return {rollout_id: (await store.get_rollout(rollout_id))["status"] for rollout_id in rollout_ids}


async def test_a_rollout_idle_past_the_limit_is_expired_and_one_with_a_recent_call_or_reward_is_not(store):
    for rollout_id in ("idle", "called", "rewarded", "finished"):
        await store.create_rollout(NewRollout(rollout_id))
    await store.finish_rollout("finished", "completed", None)
    since = time.time()  # the rollouts were created before, the activity below comes after
    await store.writer.insert_turns([turn("called", since + 5.0)])
    await store.add_reward("rewarded", Reward(0.5))

    first = await store.expire_idle(60.0, now=since + 60.0)
    after_first = await statuses(store, "idle", "called", "rewarded", "finished")
    again = await store.expire_idle(60.0, now=since + 60.0)
    later = await store.expire_idle(60.0, now=since + 3600.0)

    assert first == ["idle"]
    assert after_first == {
        "idle": "expired",
        "called": "running",
        "rewarded": "running",
        "finished": "completed",
    }
    assert again == []  # idempotent: whichever process sweeps next finds nothing to do
    assert later == ["called", "rewarded"]
    assert (await store.get_rollout("idle"))["finished_at"] == since + 60.0
    assert (await store.backlog()).running == 0
    assert (await store.backlog()).expired == 3


async def test_an_expired_rollout_takes_no_turn_and_cannot_be_finished(store):
    await store.create_rollout(NewRollout("r"))
    await store.writer.insert_turns([turn("r", time.time())])
    await store.expire_idle(60.0, now=time.time() + 3600.0)

    with pytest.raises(StoreError) as late_turn:
        await store.writer.insert_turns([turn("r", time.time())])
    with pytest.raises(StoreError) as late_finish:
        await store.finish_rollout("r", "completed", Reward(1.0))
    shown = await store.get_rollout("r")

    assert (late_turn.value.code, late_finish.value.code) == ("rollout_expired", "rollout_expired")
    assert (shown["status"], len(shown["turns"]), shown["reward"], shown["rewards"]) == (
        "expired",
        1,
        None,
        [],
    )


async def test_expired_rollouts_leave_their_servers_load_and_new_rollouts_spread_again(store):
    fleet = fleet_of(["http://s0", "http://s1", "http://s2"], pins=store)
    try:
        for i in range(6):  # a previous run's rollouts on s0, never finished
            await store.pin(f"old-{i}", lambda _: "http://s0", fleet.urls)
        await fleet.route("mine", None)  # and one this process placed
        await sweep(store, fleet, 60.0, now=time.time() + 3600.0)
        pinned = [server.pinned for server in fleet.servers.values()]

        placed = await asyncio.gather(*(fleet.route(f"new-{i}", None) for i in range(6)))
    finally:
        await fleet.close()

    assert pinned == [0, 0, 0]
    assert Counter(server.url for server, _ in placed) == {"http://s0": 2, "http://s1": 2, "http://s2": 2}


async def test_a_group_with_an_expired_member_is_served_with_it_as_failed(db, store):
    for rollout_id in ("a", "b", "crashed"):
        await store.create_rollout(NewRollout(rollout_id, group_id="g", group_size=3))
        await store.writer.insert_turns([turn(rollout_id, time.time())])
    for rollout_id, reward in (("a", 1.0), ("b", 0.0)):
        await store.finish_rollout(rollout_id, "completed", Reward(reward))

    with TrainerClient(db) as client:
        waiting = client.claim("trainer-0", 0)
        await store.expire_idle(60.0, now=time.time() + 3600.0)
        served = client.claim("trainer-0", 1)

    assert waiting.samples == []
    assert {sample.rollout_id: round(sample.advantage, 3) for sample in served.samples} == {
        "a": 1.0,
        "b": -1.0,
    }
    assert served.counts["skipped_failed"] == 1


async def test_a_rollout_another_process_expired_refuses_this_process_next_turn(db, store):
    other = Store(db)  # another gateway process: a store of its own on the same database
    try:
        await store.create_rollout(NewRollout("r"))
        await store.writer.insert_turns([turn("r", time.time())])  # this process knows it running
        await other.expire_idle(60.0, now=time.time() + 3600.0)

        with pytest.raises(StoreError) as late_turn:
            await store.writer.insert_turns([turn("r", time.time())])
        state = await store.rollout_state("r")
    finally:
        other.close()

    assert late_turn.value.code == "rollout_expired"
    assert state is not None and state.status == "expired"  # the next call is refused before any engine
    assert len((await store.get_rollout("r"))["turns"]) == 1
