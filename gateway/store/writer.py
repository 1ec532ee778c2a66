"""Group commit: every write of the gateway goes through one thread that commits batches.

Requests enqueue an operation and await its future. The writer thread takes everything queued, runs the
operations in one transaction, commits once, then resolves the futures. While a commit (and its fsync) is in
flight, new operations pile up and share the next one, so durability costs one commit per batch instead of
one per turn and never blocks the event loop. The writer also caches what it needs to know of each rollout
(status, lineage of its turns), so a turn of a known rollout is one INSERT.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from gateway.store import reads, schema
from gateway.store.chain import Lineage, Node, find_parent, lineage_of, place, reply_message
from gateway.store.records import NewRollout, Reward, RolloutState, StoreError, TurnRecord
from gateway.store.tokens import pack_ids, pack_logprobs

log = logging.getLogger(__name__)

Operation = Callable[[Connection], Any]
# Replicas writing one rollout at the same moment race for its next turn index; the loser retries.
_CONFLICT_ATTEMPTS = 10
# Built once: executing a prebuilt statement with a parameter dict skips SQLAlchemy's per-call construction.
_INSERT_TURN = insert(schema.turns)
_INSERT_ROLLOUT = insert(schema.rollouts)
_INSERT_REWARD = insert(schema.rewards)


@dataclass
class _Pending:
    operation: Operation
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class LineageCache:
    """Lineages of recent rollouts, bounded by the number of ids held; owned by the writer thread."""

    def __init__(self, max_tokens: int) -> None:
        self._entries: OrderedDict[str, Lineage] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._tokens = 0
        self.max_tokens = max_tokens

    def get(self, rollout_id: str) -> Lineage | None:
        entry = self._entries.get(rollout_id)
        if entry is not None:
            self._entries.move_to_end(rollout_id)
        return entry

    def put(self, rollout_id: str, entry: Lineage) -> None:
        self.drop(rollout_id)
        self._entries[rollout_id] = entry
        self._sizes[rollout_id] = entry.tokens
        self._tokens += self._sizes[rollout_id]
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            self.drop(next(iter(self._entries)))

    def drop(self, rollout_id: str) -> None:
        if self._entries.pop(rollout_id, None) is not None:
            self._tokens -= self._sizes.pop(rollout_id)


class StoreWriter:
    """Runs every write of the gateway in one thread, many operations per transaction.

    Operations validate before they write (a refusal is a `StoreError` and leaves the batch intact). If the
    database rejects a batch (say, another gateway replica took a turn index first), each operation is run
    again alone, with its caches dropped, so one conflict never fails the others.
    """

    def __init__(self, engine: Engine, *, max_batch: int = 512, chain_cache_tokens: int = 50_000_000) -> None:
        self._engine = engine
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._lineages = LineageCache(chain_cache_tokens)
        self.rollouts: dict[str, RolloutState] = {}
        """Status and mode of rollouts this process has seen, as of the latest commit."""
        # Changes made by the transaction in progress; published to the caches above once it commits.
        self._batch_lineages: dict[str, Lineage] = {}
        self._batch_states: dict[str, RolloutState] = {}
        self._finished: list[str] = []
        self._early_retries: dict[tuple[str, str, int], dict[int, int]] = {}
        """Retries committed before the attempt they repeat: (rollout, request hash, choice) -> {turn: attempt}."""
        self.commits = 0
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    # -- public async API ---------------------------------------------------------------------------------

    def submit(self, operation: Operation) -> asyncio.Future[Any]:
        """Enqueue without awaiting: safe from a cancelled task (the write still happens)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put(_Pending(operation, future, loop))
        return future

    def enqueue_turns(self, records: list[TurnRecord]) -> asyncio.Future[list[int]]:
        return self.submit(lambda conn: [self._insert_turn(conn, record) for record in records])

    async def insert_turns(self, records: list[TurnRecord]) -> list[int]:
        """Store a call's turns (one per choice) in one transaction; their indexes once committed."""
        return await self.enqueue_turns(records)

    async def parent_of(self, rollout_id: str, messages: list[dict[str, Any]]) -> Node | None:
        """The committed turn a chat request extends (with its full ids), if any: exact mode splices onto it."""
        return await self.submit(lambda conn: self._parent(conn, rollout_id, messages))

    async def create_rollout(self, new: NewRollout) -> tuple[dict[str, Any], bool]:
        return await self.submit(lambda conn: self._create_rollout(conn, new))

    async def add_reward(self, rollout_id: str, reward: Reward) -> None:
        await self.submit(lambda conn: self._add_reward(conn, rollout_id, reward))

    async def finish_rollout(self, rollout_id: str, status: str, reward: Reward | None) -> dict[str, Any]:
        """Close a running rollout, with its final reward if given; returns the rollout's row."""
        return await self.submit(lambda conn: self._finish(conn, rollout_id, status, reward))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # -- writer thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
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
                outcomes = self._transaction([p.operation for p in batch])
            except IntegrityError as exc:  # another replica took a turn index: expected, retried below
                log.info(
                    "a batch of %d writes conflicted (%s); retrying them one by one", len(batch), exc.orig
                )
                outcomes = [self._alone(p.operation) for p in batch]
            except Exception:  # retried one by one below
                log.warning(
                    "a batch of %d writes failed; retrying them one by one", len(batch), exc_info=True
                )
                outcomes = [self._alone(p.operation) for p in batch]
            for pending, (result, error) in zip(batch, outcomes):
                pending.loop.call_soon_threadsafe(_resolve, pending.future, result, error)

    def _transaction(self, operations: list[Operation]) -> list[tuple[Any, BaseException | None]]:
        outcomes: list[tuple[Any, BaseException | None]] = []
        self._batch_lineages.clear()
        self._batch_states.clear()
        self._finished.clear()
        try:
            with self._engine.connect() as conn, conn.begin():
                for operation in operations:
                    try:
                        outcomes.append((operation(conn), None))
                    except StoreError as exc:  # refused before writing anything
                        outcomes.append((None, exc))
        except BaseException:
            for rollout_id in self._batch_lineages:  # they hold turns that were not committed
                self._lineages.drop(rollout_id)
            raise
        self.commits += 1
        for rollout_id, lineage in self._batch_lineages.items():
            self._lineages.put(rollout_id, lineage)
        for rollout_id in self._finished:
            self._lineages.drop(rollout_id)
        self.rollouts.update(self._batch_states)
        if len(self.rollouts) > 200_000:
            for key in list(self.rollouts)[:50_000]:
                del self.rollouts[key]
        return outcomes

    def _alone(self, operation: Operation) -> tuple[Any, BaseException | None]:
        error: BaseException | None = None
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                return self._transaction([operation])[0]
            except IntegrityError as exc:  # another writer got there first: re-read, back off, try again
                error = exc
                self._lineages = LineageCache(self._lineages.max_tokens)
                self.rollouts.clear()
                time.sleep(random.uniform(0, 0.001 * 2**attempt))
            except Exception as exc:  # handed to the caller's future
                log.exception("a store write failed")
                return None, exc
        return None, error

    # -- what the database holds, through this process's caches -----------------------------------------

    def _rollout_row(self, conn: Connection, rollout_id: str) -> dict[str, Any] | None:
        row = conn.execute(select(schema.rollouts).where(schema.rollouts.c.rollout_id == rollout_id)).first()
        return dict(row._mapping) if row is not None else None

    def _state(self, conn: Connection, rollout_id: str) -> RolloutState | None:
        state = self._batch_states.get(rollout_id) or self.rollouts.get(rollout_id)
        return state if state is not None else reads.rollout_state(conn, rollout_id)

    def _lineage(self, conn: Connection, rollout_id: str) -> Lineage:
        lineage = self._batch_lineages.get(rollout_id) or self._lineages.get(rollout_id)
        if lineage is None:
            lineage, _ = lineage_of(self._rows(conn, rollout_id))
        self._batch_lineages[rollout_id] = lineage
        return lineage

    def _rows(self, conn: Connection, rollout_id: str) -> list[Any]:
        t = schema.turns
        return list(
            conn.execute(
                select(
                    t.c.turn_index,
                    t.c.status,
                    t.c.parent_turn,
                    t.c.forked_from,
                    t.c.prefix_tokens,
                    t.c.prompt_ids,
                    t.c.completion_ids,
                    t.c.prefix_messages,
                    t.c.messages,
                    t.c.content,
                    t.c.tool_calls,
                    t.c.finish_reason,
                )
                .where(t.c.rollout_id == rollout_id)
                .order_by(t.c.turn_index)
            ).mappings()
        )

    def _node(self, conn: Connection, rollout_id: str, index: int) -> Node:
        """A turn's full ids and messages, read back from the database (it left the in-memory lineage)."""
        _, nodes = lineage_of(self._rows(conn, rollout_id))
        return nodes[index]

    # -- operations (writer thread; each validates before it writes) -------------------------------------

    def _create_rollout(self, conn: Connection, new: NewRollout) -> tuple[dict[str, Any], bool]:
        existing = self._rollout_row(conn, new.rollout_id)
        if existing is not None:
            for name in ("group_id", "task_id", "mode", "tags", "limits"):
                given = new.limits.to_json() if name == "limits" else getattr(new, name)
                if given is not None and given != existing[name]:
                    raise StoreError(
                        409,
                        f"rollout {new.rollout_id!r} exists with {name}={existing[name]!r}, not {given!r}",
                        "rollout_conflict",
                    )
            return existing, False
        return self._insert_rollout(conn, new), True

    def _insert_rollout(self, conn: Connection, new: NewRollout) -> dict[str, Any]:
        row = {
            "rollout_id": new.rollout_id,
            "group_id": new.group_id or new.rollout_id,
            "task_id": new.task_id,
            "metadata": new.metadata,
            "status": schema.ROLLOUT_RUNNING,
            "reward": None,
            "reward_components": None,
            "created_at": time.time(),
            "finished_at": None,
            "mode": new.mode,
            "tags": new.tags,
            "eval": new.eval,
            "api_key_hash": new.api_key_hash,
            "limits": new.limits.to_json(),
            "end_reason": None,
        }
        conn.execute(_INSERT_ROLLOUT, row)
        self._batch_states[new.rollout_id] = RolloutState(
            schema.ROLLOUT_RUNNING, new.mode, new.api_key_hash, new.limits
        )
        self._batch_lineages[new.rollout_id] = Lineage()
        return row

    def _insert_turn(self, conn: Connection, record: TurnRecord) -> int:
        state = self._state(conn, record.rollout_id)
        if state is not None and state.status != schema.ROLLOUT_RUNNING:
            raise StoreError(
                409, f"rollout {record.rollout_id!r} is already {state.status}", "rollout_finished"
            )
        if state is None:
            self._insert_rollout(conn, NewRollout(record.rollout_id))
            state = self._batch_states[record.rollout_id]
        lineage = self._lineage(conn, record.rollout_id)
        index = lineage.last_index + 1
        if record.request_hash is not None:
            self._link_retries(conn, record, index)
        placement = place(
            lineage,
            record.prompt_ids,
            record.messages,
            lambda i: self._node(conn, record.rollout_id, i),
            plain_prompt_ids=record.plain_prompt_ids,
        )
        conn.execute(
            _INSERT_TURN,
            {
                "rollout_id": record.rollout_id,
                "turn_index": index,
                "endpoint": record.endpoint,
                "model": record.model,
                "stream": record.stream,
                "status": record.status,
                "error": record.error,
                "http_status": record.http_status,
                "backend": record.backend,
                "policy_version": record.policy_version,
                "policy_version_end": record.policy_version_end,
                "weight_versions": record.weight_versions,
                "prefix_messages": placement.prefix_messages,
                "messages": placement.new_messages,
                "prompt_text": record.prompt_text,
                "tools": record.tools,
                "params": record.params,
                "content": record.content,
                "reasoning": record.reasoning,
                "tool_calls": record.tool_calls,
                "finish_reason": record.finish_reason,
                "choice_index": record.choice_index,
                "request_hash": record.request_hash,
                "attempt": record.attempt,
                "retry_of": record.retry_of,
                "parent_turn": placement.parent_turn,
                "forked_from": placement.forked_from,
                "prefix_tokens": placement.prefix_tokens,
                "drift_tokens": placement.drift_tokens,
                "splice": record.splice,
                "prompt_ids": pack_ids(placement.prompt_suffix),
                "completion_ids": pack_ids(record.completion_ids),
                "completion_logprobs": pack_logprobs(record.completion_logprobs),
                "prompt_tokens": int(record.prompt_ids.shape[0]),
                "completion_tokens": int(record.completion_ids.shape[0]),
                "started_at": record.started_at,
                "first_token_at": record.first_token_at,
                "finished_at": record.finished_at,
            },
        )
        ok = record.status == schema.TURN_OK
        if ok and record.choice_index == 0:
            self._batch_states[record.rollout_id] = replace(state, calls=state.calls + 1)
        if record.refused_by is not None:
            conn.execute(
                update(schema.rollouts)
                .where(schema.rollouts.c.rollout_id == record.rollout_id)
                .values(end_reason=record.refused_by)
            )
        lineage.add(
            index,
            record.messages,
            np.concatenate([record.prompt_ids, record.completion_ids]),
            reply_message(record.content, record.tool_calls) if ok else None,
            record.finish_reason,
        )
        return index

    def _link_retries(self, conn: Connection, record: TurnRecord, index: int) -> None:
        """Point a client's retry at the attempt it repeats (the latest lower attempt of the same request).

        An earlier attempt can commit after its retry (its client gave up, the gateway went on): the retry
        waits in `_early_retries` and is linked when the attempt it repeats arrives.
        """
        t = schema.turns
        key = (record.rollout_id, record.request_hash or "", record.choice_index)
        if record.attempt > 0:
            earlier = conn.execute(
                select(t.c.turn_index)
                .where(
                    t.c.rollout_id == record.rollout_id,
                    t.c.request_hash == record.request_hash,
                    t.c.attempt < record.attempt,
                    t.c.choice_index == record.choice_index,
                )
                .order_by(t.c.attempt.desc(), t.c.turn_index.desc())
                .limit(1)
            ).scalar()
            record.retry_of = earlier
            if earlier is None:
                self._early_retries.setdefault(key, {})[index] = record.attempt
                if len(self._early_retries) > 10_000:  # retries whose first attempt never came
                    self._early_retries.pop(next(iter(self._early_retries)))
        waiting = self._early_retries.get(key)
        if waiting:
            later = [turn for turn, attempt in waiting.items() if attempt > record.attempt]
            if later:
                conn.execute(
                    update(t)
                    .where(
                        t.c.rollout_id == record.rollout_id, t.c.turn_index.in_(later), t.c.retry_of.is_(None)
                    )
                    .values(retry_of=index)
                )
                for turn in later:
                    del waiting[turn]

    def _parent(self, conn: Connection, rollout_id: str, messages: list[dict[str, Any]]) -> Node | None:
        lineage = self._lineage(conn, rollout_id)
        parent, _ = find_parent(
            lineage, np.empty(0, dtype=np.int32), messages, lambda i: self._node(conn, rollout_id, i)
        )
        if parent is None:
            return None
        node = lineage.nodes.get(parent)
        return (
            node if node is not None and node.sequence is not None else self._node(conn, rollout_id, parent)
        )

    def _require_rollout(self, conn: Connection, rollout_id: str) -> dict[str, Any]:
        row = self._rollout_row(conn, rollout_id)
        if row is None:
            raise StoreError(404, f"rollout {rollout_id!r} does not exist", "rollout_not_found")
        return row

    def _add_reward(self, conn: Connection, rollout_id: str, reward: Reward) -> None:
        self._require_rollout(conn, rollout_id)
        if reward.turn_index is not None:
            t = schema.turns
            found = conn.execute(
                select(t.c.turn_id).where(t.c.rollout_id == rollout_id, t.c.turn_index == reward.turn_index)
            ).first()
            if found is None:
                raise StoreError(
                    404, f"rollout {rollout_id!r} has no turn {reward.turn_index}", "turn_not_found"
                )
        self._write_reward(conn, rollout_id, reward)

    def _write_reward(self, conn: Connection, rollout_id: str, reward: Reward) -> None:
        conn.execute(
            _INSERT_REWARD,
            {
                "rollout_id": rollout_id,
                "turn_index": reward.turn_index,
                "value": reward.value,
                "components": reward.components,
                "created_at": time.time(),
            },
        )
        if reward.turn_index is None:
            conn.execute(
                update(schema.rollouts)
                .where(schema.rollouts.c.rollout_id == rollout_id)
                .values(reward=reward.value, reward_components=reward.components)
            )

    def _finish(
        self, conn: Connection, rollout_id: str, status: str, reward: Reward | None
    ) -> dict[str, Any]:
        row = self._require_rollout(conn, rollout_id)
        if row["status"] != schema.ROLLOUT_RUNNING:
            raise StoreError(409, f"rollout {rollout_id!r} is already {row['status']}", "rollout_finished")
        if reward is not None:
            self._write_reward(conn, rollout_id, reward)
            row.update(reward=reward.value, reward_components=reward.components)
        finished_at = time.time()
        conn.execute(
            update(schema.rollouts)
            .where(schema.rollouts.c.rollout_id == rollout_id)
            .values(status=status, finished_at=finished_at)
        )
        known = self._state(conn, rollout_id) or RolloutState(status, row["mode"])
        self._batch_states[rollout_id] = replace(known, status=status)
        self._finished.append(rollout_id)
        row.update(status=status, finished_at=finished_at)
        return row


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
