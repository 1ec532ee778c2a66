"""A rollout an agent's first call creates (no `POST /rollouts` before it) is created as `POST /rollouts` with
its id alone would create it: in the group its id names, which it joins, or is refused by with the same 409 as
any new member, leaving nothing stored. On SQLite and PostgreSQL, by both ways a first call creates it: its
server's pin, and its first turn."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from gateway.store.records import NewRollout, Reward, StoreError, TurnRecord
from gateway.store.store import Store
from trainer_client import TrainerClient

SERVER = "http://s0"


def turn(rollout_id: str) -> TurnRecord:
    return TurnRecord(
        rollout_id=rollout_id,
        endpoint="chat",
        model=None,
        stream=False,
        policy_version="0",
        started_at=0.0,
        finished_at=1.0,
        prompt_ids=np.array([1, 2, 3], dtype=np.int32),
        completion_ids=np.array([7, 8], dtype=np.int32),
        completion_logprobs=np.array([-0.5, -0.25], dtype=np.float32),
    )


async def pin(store: Store, rollout_id: str) -> str:
    """The agent's first call reaching the fleet: the rollout's server."""
    return (await store.pin(rollout_id, lambda _: SERVER, [SERVER])).url


async def first_turn(store: Store, rollout_id: str) -> list[int]:
    """The agent's first call stored (a gateway whose fleet pins in memory alone)."""
    return await store.writer.insert_turns([turn(rollout_id)])


FIRST_CALLS = {"pin": pin, "turn": first_turn}


async def play(store: Store, rollout_id: str, **fields: Any) -> None:
    await store.create_rollout(NewRollout(rollout_id, **fields))
    await store.writer.insert_turns([turn(rollout_id)])
    await store.finish_rollout(rollout_id, "completed", Reward(1.0))


def groups(store: Store) -> dict[str, tuple[int | None, int]]:
    """Each group's declared size and members, as the documented `group_stats` view counts them."""
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT group_id, group_size, rollouts FROM group_stats"))
        return {group: (size, members) for group, size, members in rows}


def refusal(store: Store, first_call: str, rollout_id: str) -> tuple[str, str]:
    async def call() -> None:
        await FIRST_CALLS[first_call](store, rollout_id)

    with pytest.raises(StoreError) as refused:
        asyncio.run(call())
    return refused.value.code, refused.value.message


@pytest.mark.parametrize("first_call", FIRST_CALLS)
def test_a_first_call_on_the_id_of_a_full_group_is_refused_and_leaves_it_whole(store, first_call):
    async def full() -> None:
        for member in ("a", "b"):
            await play(store, member, group_id="g", group_size=2)

    asyncio.run(full())

    assert refusal(store, first_call, "g") == ("group_full", "group 'g' has its 2 members already")
    assert asyncio.run(store.get_rollout("g")) is None
    assert groups(store) == {"g": (2, 2)}


@pytest.mark.parametrize("first_call", FIRST_CALLS)
def test_a_first_call_on_the_id_of_a_claimed_group_is_refused_and_leaves_it_as_claimed(db, store, first_call):
    asyncio.run(play(store, "a", group_id="g"))
    with TrainerClient(db) as client:
        assert [sample.rollout_id for sample in client.claim("trainer-0", 0).samples] == ["a"]

    assert refusal(store, first_call, "g") == (
        "group_claimed",
        "group 'g' was taken by a trainer already: a new member would not train with it",
    )
    assert asyncio.run(store.get_rollout("g")) is None
    assert groups(store) == {"g": (None, 1)}


@pytest.mark.parametrize("first_call", FIRST_CALLS)
def test_a_first_call_on_the_id_of_a_group_with_room_joins_it_with_its_declared_size(store, first_call):
    asyncio.run(store.create_rollout(NewRollout("a", group_id="g", group_size=2)))

    asyncio.run(FIRST_CALLS[first_call](store, "g"))

    joined = asyncio.run(store.get_rollout("g"))
    assert (joined["group_id"], joined["group_size"]) == ("g", 2)
    assert groups(store) == {"g": (2, 2)}


@pytest.mark.parametrize("first_call", FIRST_CALLS)
def test_a_first_call_on_a_new_id_creates_a_group_of_its_own(store, first_call):
    asyncio.run(FIRST_CALLS[first_call](store, "solo"))

    created = asyncio.run(store.get_rollout("solo"))
    assert (created["group_id"], created["group_size"], created["status"]) == ("solo", None, "running")
    assert groups(store) == {"solo": (None, 1)}
