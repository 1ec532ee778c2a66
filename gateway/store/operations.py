"""The SQL of each write the gateway makes, run by the writer thread inside its transactions.

Each operation validates before it writes: a refusal is a `StoreError` and leaves the transaction intact for
the other operations of the batch. What the database already holds of a rollout is read through the writer's
caches (`caches`), so a turn of a known rollout is one INSERT; its place in the rollout comes from `lineage`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import numpy as np
from sqlalchemy import func, insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from gateway.store import pins, reads
from gateway.store.caches import WriterCaches
from gateway.store.lineage import Lineage, Node, find_parent, lineage_of, place, reply_message, with_reply
from gateway.store.records import NewRollout, Reward, RolloutState, StoreError, TurnRecord, not_running
from gateway.store.turn_rows import row_of
from rollout_store import schema
from rollout_store.database import DriverStatement
from rollout_store.status import RolloutStatus, TurnStatus

# Built once: executing a prebuilt statement with a parameter dict skips SQLAlchemy's per-call construction.
# Those of every agent call run on the driver's cursor (`DriverStatement`).
_INSERT_TURN = DriverStatement(insert(schema.turns))
_INSERT_ROLLOUT = insert(schema.rollouts)
_INSERT_REWARD = insert(schema.rewards)
_CREATE_IF_ABSENT = {
    "sqlite": DriverStatement(
        sqlite.insert(schema.rollouts).on_conflict_do_nothing(index_elements=["rollout_id"])
    ),
    "postgresql": DriverStatement(
        postgresql.insert(schema.rollouts).on_conflict_do_nothing(index_elements=["rollout_id"])
    ),
}
"""A rollout created on its agent's first call: one statement, whose rowcount says whether it already
existed."""


_LOCK_ROLLOUTS = text(
    "SELECT pg_advisory_xact_lock(:space, key) FROM unnest(CAST(:keys AS integer[])) AS key"
).bindparams(space=0x726C)  # "rl": a key space of the store's own among the database's advisory locks
"""Transaction-scoped locks on rollouts, taken in the order given (unnest yields the keys in order)."""


def lock_rollouts(conn: Connection, rollout_ids: Collection[str]) -> None:
    """On PostgreSQL, lock the rollouts a transaction will write, by their keys in ascending order, before
    it writes: row locks taken as writes go (a turn's trigger shares its rollout's row, an update takes it)
    would be taken in each transaction's own order, and two processes writing the same rollouts in two
    orders would deadlock. Rollouts to be created are locked alike, so two processes creating the same ones
    wait too. (SQLite has one writer at a time.)"""
    if rollout_ids and conn.dialect.name == "postgresql":
        conn.execute(_LOCK_ROLLOUTS, {"keys": sorted({_lock_key(r) for r in rollout_ids})})


def _lock_key(rollout_id: str) -> int:
    """A rollout's lock key: a signed 32-bit digest of its id, the same in every process."""
    return int.from_bytes(hashlib.blake2b(rollout_id.encode(), digest_size=4).digest(), "big", signed=True)


def group_lock(group_id: str) -> str:
    """The name a group is locked under among the rollouts' locks (`lock_rollouts`): no rollout id has a
    space."""
    return f"group {group_id}"


def _rollout_row(new: NewRollout) -> dict[str, Any]:
    return {
        "rollout_id": new.rollout_id,
        "group_id": new.group_id or new.rollout_id,
        "group_size": new.group_size,
        "task_id": new.task_id,
        "metadata": new.metadata,
        "status": RolloutStatus.RUNNING,
        "reward": None,
        "reward_components": None,
        "created_at": time.time(),
        "finished_at": None,
        "mode": new.mode,
        "tags": new.tags,
        "eval": new.eval,
        "api_key_hash": new.api_key_hash,
        "limits": new.limits.to_json(),
        "sampling": new.sampling,
        "end_reason": None,
        "policy": new.policy,
    }


def _joining(conn: Connection, new: NewRollout) -> NewRollout:
    """The new rollout as a member of its group: refused where it would change a group a trainer may already
    have taken (past its declared size, after a claim) or contradict the size the group was declared with;
    otherwise it carries the group's declared size."""
    group_id = new.group_id or new.rollout_id
    r = schema.rollouts
    members, declared, claimed = conn.execute(
        select(func.count(), func.max(r.c.group_size), func.count(r.c.claimed_by)).where(
            r.c.group_id == group_id
        )
    ).one()
    if not members:
        return new
    if new.group_size is not None and new.group_size != declared:
        declared_as = f"declared with {declared} members" if declared else "created without a group_size"
        raise StoreError(
            f"group {group_id!r} was {declared_as}: a member cannot declare {new.group_size}",
            "group_size_conflict",
        )
    if declared is not None and members >= declared:
        raise StoreError(f"group {group_id!r} has its {declared} members already", "group_full")
    if claimed:
        raise StoreError(
            f"group {group_id!r} was taken by a trainer already: a new member would not train with it",
            "group_claimed",
        )
    return replace(new, group_size=declared)


class Operations:
    def __init__(self, caches: WriterCaches) -> None:
        self._caches = caches

    def create_rollout(self, conn: Connection, new: NewRollout) -> tuple[dict[str, Any], bool]:
        existing = reads.rollout_row(conn, new.rollout_id)
        if existing is not None:
            for name in ("group_id", "group_size", "task_id", "mode", "tags", "limits", "sampling"):
                given = new.limits.to_json() if name == "limits" else getattr(new, name)
                if given is not None and given != existing[name]:
                    raise StoreError(
                        f"rollout {new.rollout_id!r} exists with {name}={existing[name]!r}, not {given!r}",
                        "rollout_conflict",
                    )
            return existing, False
        return self._insert_rollout(conn, _joining(conn, new)), True

    def _insert_rollout(self, conn: Connection, new: NewRollout) -> dict[str, Any]:
        row = _rollout_row(new)
        conn.execute(_INSERT_ROLLOUT, row)
        self._created(new)
        return row

    def _created(self, new: NewRollout) -> RolloutState:
        """Remember a rollout this transaction created: running, no turns yet."""
        state = RolloutState(
            RolloutStatus.RUNNING,
            new.mode,
            new.api_key_hash,
            new.limits,
            sampling=new.sampling,
            group_size=new.group_size,
            policy=new.policy,
        )
        self._caches.set_state(new.rollout_id, state)
        self._caches.hold_lineage(new.rollout_id, Lineage())
        return state

    def _create_if_absent(self, conn: Connection, rollout_id: str) -> RolloutState | None:
        """Create the rollout an agent calls before anyone registered it; None if it exists already. It is
        created as `POST /rollouts` with its id alone would create it: its group is the one its id names,
        which it joins or is refused by (`_joining`) as any new member."""
        new = _joining(conn, NewRollout(rollout_id))
        created = _CREATE_IF_ABSENT[conn.dialect.name].execute(conn, _rollout_row(new))
        return self._created(new) if created == 1 else None

    def pin(
        self,
        conn: Connection,
        rollout_id: str,
        pick: pins.Pick,
        keep: Collection[str],
        cached: dict[str, int] | None,
    ) -> pins.Pin | str:
        """The rollout's server (`gateway.store.pins`: a pin, or MOVES), creating the rollout an agent calls
        before anyone registered it: one transaction, not three."""
        answer = pins.pin(conn, rollout_id, pick, keep, cached)
        if answer == pins.MISSING:
            self._create_if_absent(conn, rollout_id)  # or another replica just did
            answer = pins.pin(conn, rollout_id, pick, keep, cached)
        assert answer != pins.MISSING, "the rollout exists: it was just created or found"
        return answer

    def insert_turn(self, conn: Connection, record: TurnRecord) -> int:
        state = (
            self._state(conn, record.rollout_id)
            or self._create_if_absent(conn, record.rollout_id)
            or self._state(conn, record.rollout_id)
        )
        assert state is not None, "the rollout exists: it was just created or found"
        if state.status != RolloutStatus.RUNNING:
            raise not_running(record.rollout_id, state.status)
        if state.policy is None and record.model is not None:
            state = self._trains(conn, record.rollout_id, state, record.model)
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
            prompt_completions=record.prompt_completions,
        )
        _INSERT_TURN.execute(conn, row_of(record, index, placement))
        ok = record.status == TurnStatus.OK
        if ok and record.choice_index == 0:
            self._caches.set_state(record.rollout_id, replace(state, calls=state.calls + 1))
        if record.refused_by is not None:
            conn.execute(
                update(schema.rollouts)
                .where(schema.rollouts.c.rollout_id == record.rollout_id)
                .values(end_reason=record.refused_by)
            )
        sequence = np.concatenate([record.prompt_ids, record.completion_ids])
        lineage.add(
            index,
            record.messages,
            sequence,
            reply_message(record.content, record.tool_calls) if ok else None,
            record.finish_reason,
            with_reply(placement.prompt_completions, record.prompt_ids.shape[0], sequence.shape[0]),
            placement.hashes,
        )
        return index

    def _trains(self, conn: Connection, rollout_id: str, state: RolloutState, model: str) -> RolloutState:
        """A rollout that did not say which policy it trains trains the model of its first call."""
        r = schema.rollouts
        conn.execute(update(r).where(r.c.rollout_id == rollout_id, r.c.policy.is_(None)).values(policy=model))
        state = replace(state, policy=model)
        self._caches.set_state(rollout_id, state)
        return state

    def _link_retries(self, conn: Connection, record: TurnRecord, index: int) -> None:
        """Point a client's retry at the attempt it repeats (the latest lower attempt of the same request).

        An earlier attempt can commit after its retry (its client gave up, the gateway went on): the retry
        waits in the caches and is linked when the attempt it repeats arrives.
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
                self._caches.remember_early_retry(key, index, record.attempt)
        waiting = self._caches.early_retries.get(key)
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

    def parent(self, conn: Connection, rollout_id: str, messages: list[dict[str, Any]]) -> Node | None:
        lineage = self._lineage(conn, rollout_id)
        parent, _ = find_parent(
            lineage, np.empty(0, dtype=np.int32), messages, lambda i: self._node(conn, rollout_id, i)
        )
        if parent is None:
            return None
        return lineage.nodes.get(parent) or self._node(conn, rollout_id, parent)

    def _require_rollout(self, conn: Connection, rollout_id: str) -> dict[str, Any]:
        row = reads.rollout_row(conn, rollout_id)
        if row is None:
            raise StoreError(f"rollout {rollout_id!r} does not exist", "rollout_not_found")
        return row

    def add_reward(self, conn: Connection, rollout_id: str, reward: Reward) -> None:
        self._require_rollout(conn, rollout_id)
        if reward.turn_index is not None:
            t = schema.turns
            found = conn.execute(
                select(t.c.turn_id).where(t.c.rollout_id == rollout_id, t.c.turn_index == reward.turn_index)
            ).first()
            if found is None:
                raise StoreError(f"rollout {rollout_id!r} has no turn {reward.turn_index}", "turn_not_found")
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

    def finish(self, conn: Connection, rollout_id: str, status: str, reward: Reward | None) -> dict[str, Any]:
        row = self._require_rollout(conn, rollout_id)
        if row["status"] != RolloutStatus.RUNNING:
            raise not_running(rollout_id, row["status"])
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
        self._caches.set_state(rollout_id, replace(known, status=status))
        self._caches.finished(rollout_id)
        row.update(status=status, finished_at=finished_at)
        return row

    # -- what the database holds, through the caches --------------------------------------------------

    def _state(self, conn: Connection, rollout_id: str) -> RolloutState | None:
        """From the caches (rollouts this process wrote), else read: another replica may change it."""
        state = self._caches.state(rollout_id)
        return state if state is not None else reads.rollout_state(conn, rollout_id)

    def _lineage(self, conn: Connection, rollout_id: str) -> Lineage:
        lineage = self._caches.lineage(rollout_id)
        if lineage is None:
            lineage, _ = lineage_of(reads.turns_in_order(conn, rollout_id, replies=True))
        self._caches.hold_lineage(rollout_id, lineage)
        return lineage

    def _node(self, conn: Connection, rollout_id: str, index: int) -> Node:
        """A turn's full ids and messages, read back from the database (it left the in-memory lineage)."""
        _, nodes = lineage_of(reads.turns_in_order(conn, rollout_id, replies=True))
        return nodes[index]
