"""Two gateway processes writing the same rollouts on one PostgreSQL store wait for each other, whatever
order their transactions write them in: never a deadlock, which PostgreSQL takes a second to find."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier as BarrierType

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from gateway.store.records import NewRollout, Reward
from gateway.store.store import Store
from rollout_store import schema
from rollout_store.database import current_revision, ensure_schema, head_revision, make_engine


def crossing(first: str, second: str, arrived: threading.Event, other: threading.Event) -> Callable:
    """A transaction's writes: `first`'s row, then (once the other transaction wrote its first, or after a
    second and a half) `second`'s."""

    def run(conn: Connection) -> None:
        rollouts = schema.rollouts
        conn.execute(sa.update(rollouts).where(rollouts.c.rollout_id == first).values(task_id="written"))
        arrived.set()
        other.wait(1.5)
        conn.execute(sa.update(rollouts).where(rollouts.c.rollout_id == second).values(task_id="written"))

    return run


def test_two_writers_crossing_the_same_rollouts_wait_instead_of_deadlocking(databases, caplog):
    url = databases.new("postgresql")
    ensure_schema(url)
    replica_a, replica_b = Store(url), Store(url)
    caplog.set_level(logging.INFO, logger="gateway.store.writer")

    async def cross() -> None:
        for rollout_id in ("x", "y"):
            await replica_a.create_rollout(NewRollout(rollout_id))
        a_arrived, b_arrived = threading.Event(), threading.Event()
        await asyncio.gather(
            replica_a.writer.submit(crossing("x", "y", a_arrived, b_arrived), "x", "y"),
            replica_b.writer.submit(crossing("y", "x", b_arrived, a_arrived), "y", "x"),
        )
        # The store's own writes take the same locks: a reward and a finish through the other replica.
        await asyncio.gather(
            replica_a.add_reward("y", Reward(1.0)), replica_b.finish_rollout("y", "completed", None)
        )

    try:
        asyncio.run(cross())
    finally:
        replica_a.close()
        replica_b.close()

    assert [r.getMessage() for r in caplog.records if "conflicted" in r.getMessage()] == []


def _start_replica(url: str, together: BarrierType, failed: Queue) -> None:
    """What a `gateway serve` process does first, once every replica is at the start line."""
    together.wait()
    try:
        ensure_schema(url)
    except Exception as exc:  # every failure is reported
        failed.put(repr(exc))


def test_two_replicas_creating_a_declared_group_at_once_create_exactly_its_size(databases):
    url = databases.new("postgresql")
    ensure_schema(url)
    replicas = [Store(url), Store(url)]

    async def burst() -> list[str]:
        outcomes = await asyncio.gather(
            *(
                replicas[member % 2].create_rollout(NewRollout(f"m{member}", "g", group_size=4))
                for member in range(10)
            ),
            return_exceptions=True,
        )
        return sorted("created" if isinstance(outcome, tuple) else outcome.code for outcome in outcomes)

    try:
        outcomes = asyncio.run(burst())
    finally:
        for replica in replicas:
            replica.close()
    engine = make_engine(url)
    with engine.connect() as conn:
        members = conn.execute(
            sa.text("SELECT rollouts, group_size FROM group_stats WHERE group_id = 'g'")
        ).one()
    engine.dispose()
    assert outcomes == ["created"] * 4 + ["group_full"] * 6
    assert tuple(members) == (4, 4)


def test_replicas_starting_together_on_an_empty_database_migrate_it_once_and_all_start(databases):
    url = databases.new("postgresql")
    spawn = multiprocessing.get_context("spawn")
    together, failed = spawn.Barrier(4), spawn.Queue()
    replicas = [spawn.Process(target=_start_replica, args=(url, together, failed)) for _ in range(4)]
    for replica in replicas:
        replica.start()
    for replica in replicas:
        replica.join()

    assert [replica.exitcode for replica in replicas] == [0] * 4
    assert [failed.get() for _ in range(failed.qsize())] == []
    engine = make_engine(url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
