"""Group commit: every write of the gateway goes through one thread that commits batches.

Requests enqueue an operation and await its future. The writer thread takes everything queued, runs the
operations in one transaction, commits once, then resolves the futures. While a commit (and its fsync) is in
flight, new operations pile up and share the next one, so durability costs one commit per batch instead of
one per turn and never blocks the event loop. The SQL of each operation is in `operations`, what the writer
remembers between transactions in `caches`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError

from gateway.store import expiry
from gateway.store.caches import WriterCaches
from gateway.store.lineage import Node
from gateway.store.operations import Operations, group_lock, lock_rollouts
from gateway.store.pins import Pick, Pin
from gateway.store.records import NewRollout, Reward, RolloutState, StoreError, TurnRecord

log = logging.getLogger(__name__)

Operation = Callable[[Connection], Any]
_T = TypeVar("_T")
# Replicas writing one rollout at the same moment race for its next turn index; the loser retries.
_CONFLICT_ATTEMPTS = 10


@dataclass
class _Pending:
    operation: Operation
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    rollouts: tuple[str, ...]
    """The rollouts it writes: locked before any operation of its transaction runs (`lock_rollouts`)."""


class StoreWriter:
    """Runs every write of the gateway in one thread, many operations per transaction.

    If the database rejects a batch (say, another gateway replica took a turn index first), each operation is
    run again alone, with the caches dropped, so one conflict never fails the others. On PostgreSQL a
    transaction first locks every rollout its operations write, in one order, so that two processes writing
    the same rollouts wait for each other instead of deadlocking (which PostgreSQL takes a second to find).
    """

    def __init__(self, engine: Engine, *, max_batch: int = 512, chain_cache_tokens: int = 50_000_000) -> None:
        self._engine = engine
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._caches = WriterCaches(chain_cache_tokens)
        self._operations = Operations(self._caches)
        self.commits = 0
        self._conn: Connection | None = None
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def known_state(self, rollout_id: str) -> RolloutState | None:
        """Status, mode, key and limits of a rollout this process has seen, as of the latest commit."""
        return self._caches.committed_state(rollout_id)

    def submit(self, operation: Callable[[Connection], _T], *rollouts: str) -> asyncio.Future[_T]:
        """Enqueue without awaiting: safe from a cancelled task (the write still happens). `rollouts`: those
        the operation writes (none for a read)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._queue.put(_Pending(operation, future, loop, rollouts))
        return future

    def enqueue_turns(self, records: list[TurnRecord]) -> asyncio.Future[list[int]]:
        """A rollout's first turn may create it, in the group its id names: that group is locked with it."""
        insert_turn = self._operations.insert_turn
        rollouts = {r.rollout_id for r in records}
        return self.submit(
            lambda conn: [insert_turn(conn, record) for record in records],
            *rollouts,
            *(group_lock(rollout_id) for rollout_id in rollouts),
        )

    async def insert_turns(self, records: list[TurnRecord]) -> list[int]:
        """Store a call's turns (one per choice) in one transaction; their indexes once committed."""
        return await self.enqueue_turns(records)

    async def parent_of(self, rollout_id: str, messages: list[dict[str, Any]]) -> Node | None:
        """The committed turn a chat request extends (with its full ids), if any: exact mode splices onto
        it."""
        return await self.submit(lambda conn: self._operations.parent(conn, rollout_id, messages))

    async def create_rollout(self, new: NewRollout) -> tuple[dict[str, Any], bool]:
        """Its group is locked with it: members created at once through several processes are counted one
        after another against the group's size."""
        group = group_lock(new.group_id or new.rollout_id)
        return await self.submit(
            lambda conn: self._operations.create_rollout(conn, new), new.rollout_id, group
        )

    async def pin(
        self, rollout_id: str, pick: Pick, keep: Collection[str], cached: dict[str, int] | None
    ) -> Pin | str:
        """A rollout's first pin may create it, in the group its id names: that group is locked with it."""
        return await self.submit(
            lambda conn: self._operations.pin(conn, rollout_id, pick, keep, cached),
            rollout_id,
            group_lock(rollout_id),
        )

    async def add_reward(self, rollout_id: str, reward: Reward) -> None:
        await self.submit(lambda conn: self._operations.add_reward(conn, rollout_id, reward), rollout_id)

    async def finish_rollout(self, rollout_id: str, status: str, reward: Reward | None) -> dict[str, Any]:
        """Close a running rollout, with its final reward if given; returns the rollout's row."""
        return await self.submit(
            lambda conn: self._operations.finish(conn, rollout_id, status, reward), rollout_id
        )

    async def expire(self, rollout_ids: list[str], cutoff: float, now: float) -> list[str]:
        """Expire the rollouts still idle since `cutoff` (`gateway.store.expiry`), locked up front like every
        write of theirs; the ones it expired."""

        def run(conn: Connection) -> list[str]:
            expired = expiry.expire(conn, rollout_ids, cutoff, now)
            self._caches.expired(expired)
            return expired

        return await self.submit(run, *rollout_ids)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # -- writer thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._disconnect()

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            try:
                outcomes = self._transaction(batch)
            except Exception as exc:  # retried one by one below
                if _conflict(exc):  # another process took a turn index or finished the rollout: expected
                    log.info(
                        "a batch of %d writes conflicted (%s); retrying them one by one", len(batch), exc
                    )
                else:
                    log.warning(
                        "a batch of %d writes failed; retrying them one by one", len(batch), exc_info=True
                    )
                outcomes = [self._alone(p) for p in batch]
            for pending, (result, error) in zip(batch, outcomes, strict=True):
                pending.loop.call_soon_threadsafe(_resolve, pending.future, result, error)

    def _connection(self) -> Connection:
        """The writer's one connection, held from batch to batch: checking one out of the pool and back in for
        every batch cost about as much as the batch's own statements (and, on PostgreSQL, a round trip to
        ping it). After a failure it is dropped, and the next batch gets a fresh one from the pool."""
        if self._conn is None:
            self._conn = self._engine.connect()
        return self._conn

    def _disconnect(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()
            except Exception:  # a connection that already broke: nothing to give back
                log.debug("closing the writer's connection failed", exc_info=True)

    def _transaction(self, batch: list[_Pending]) -> list[tuple[Any, BaseException | None]]:
        outcomes: list[tuple[Any, BaseException | None]] = []
        self._caches.begin()
        try:
            conn = self._connection()
            with conn.begin():
                lock_rollouts(conn, [rollout for pending in batch for rollout in pending.rollouts])
                for pending in batch:
                    try:
                        outcomes.append((pending.operation(conn), None))
                    except StoreError as exc:  # refused before writing anything
                        outcomes.append((None, exc))
        except BaseException:
            self._caches.abort()
            self._disconnect()
            raise
        self.commits += 1
        self._caches.commit()
        return outcomes

    def _alone(self, pending: _Pending) -> tuple[Any, BaseException | None]:
        error: BaseException | None = None
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                return self._transaction([pending])[0]
            except Exception as exc:
                if not _conflict(exc):  # handed to the caller's future
                    log.exception("a store write failed")
                    return None, exc
                error = exc  # another writer got there first: re-read, back off, try again
                self._caches.forget()
                time.sleep(random.uniform(0, 0.001 * 2**attempt))
        return None, error


_RETRIED_SQLSTATES = frozenset({"40001", "40P01"})
"""PostgreSQL's serialization failure and deadlock: the transaction lost a race and can run again."""


def _conflict(exc: BaseException) -> bool:
    """A write that lost a race with another writer (a taken turn index, a rollout finished meanwhile, a
    deadlock): worth running again after re-reading the store."""
    if isinstance(exc, IntegrityError):
        return True
    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) in _RETRIED_SQLSTATES


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
