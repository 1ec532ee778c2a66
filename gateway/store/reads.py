"""Reading rollouts back, with each turn's full prompt rebuilt from its delta."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.engine import Connection, RowMapping

from gateway.store.records import Limits, RolloutState
from gateway.store.turn_rows import SHOWN
from rollout_store import schema
from rollout_store.database import DriverStatement
from rollout_store.delta import FullTurn, rebuild
from rollout_store.status import TurnStatus
from rollout_store.tokens import unpack_ids, unpack_logprobs


def _state_query() -> Any:
    """What the agent path needs of a rollout, built once: building it on every call cost six times what
    running it does."""
    r, t = schema.rollouts, schema.turns
    rollout_id = bindparam("rollout_id", type_=r.c.rollout_id.type)
    calls = (
        select(func.count())
        .where(t.c.rollout_id == rollout_id, t.c.status == TurnStatus.OK, t.c.choice_index == 0)
        .scalar_subquery()
    )
    return select(
        r.c.status,
        r.c.mode,
        r.c.api_key_hash,
        r.c.limits,
        r.c.sampling,
        calls.label("calls"),
        r.c.group_size,
        r.c.policy,
    ).where(r.c.rollout_id == rollout_id)


_STATE = DriverStatement(_state_query())


def rollout_state(conn: Connection, rollout_id: str) -> RolloutState | None:
    row = _STATE.first(conn, {"rollout_id": rollout_id})
    if row is None:
        return None
    status, mode, api_key_hash, limits, sampling, calls, group_size, policy = row
    limited = Limits.from_json(limits)
    return RolloutState(status, mode, api_key_hash, limited, calls, sampling, group_size, policy)


_REBUILT = (
    schema.turns.c.turn_index,
    schema.turns.c.status,
    schema.turns.c.parent_turn,
    schema.turns.c.forked_from,
    schema.turns.c.prefix_tokens,
    schema.turns.c.prompt_ids,
    schema.turns.c.completion_ids,
)
"""What `delta.rebuild` restores a turn's full prompt from, with its status."""
_REPLIED = (
    schema.turns.c.prefix_messages,
    schema.turns.c.messages,
    schema.turns.c.content,
    schema.turns.c.tool_calls,
    schema.turns.c.finish_reason,
)
"""What `lineage.lineage_of` needs besides: each turn's messages and reply."""


def turns_in_order(conn: Connection, rollout_id: str, *, replies: bool) -> Sequence[RowMapping]:
    """The rollout's turns in order, as `delta.rebuild` takes them; with `replies`, as `lineage.lineage_of`
    does (their messages rebuilt too). Without, the messages are not read: a read of ids alone stays light."""
    t = schema.turns
    columns = (*_REBUILT, *_REPLIED) if replies else _REBUILT
    rows = conn.execute(select(*columns).where(t.c.rollout_id == rollout_id).order_by(t.c.turn_index))
    return rows.mappings().all()


def response_turn(conn: Connection, rollout_id: str, response_id: str) -> dict[str, Any] | None:
    """The turn a Responses agent refers to by its response's id, with its full chat messages."""
    t = schema.turns
    found = conn.execute(
        select(t.c.turn_index).where(t.c.rollout_id == rollout_id, t.c.response_id == response_id)
    ).first()
    if found is None:
        return None
    rows = (
        conn.execute(
            select(t)
            .where(t.c.rollout_id == rollout_id, t.c.turn_index <= found.turn_index)
            .order_by(t.c.turn_index)
        )
        .mappings()
        .all()
    )
    turn = dict(rows[-1])
    turn["messages"] = rebuild(rows)[found.turn_index].messages
    return turn


def rollout_row(conn: Connection, rollout_id: str) -> dict[str, Any] | None:
    """A rollout's row as stored, as a plain dict."""
    r = schema.rollouts
    row = conn.execute(select(r).where(r.c.rollout_id == rollout_id)).mappings().first()
    return dict(row) if row is not None else None


def get_rollout(
    conn: Connection, rollout_id: str, *, include_tokens: bool = False, include_messages: bool = False
) -> dict[str, Any] | None:
    row = rollout_row(conn, rollout_id)
    if row is None:
        return None
    turn_rows = _turn_rows(conn, rollout_id)
    rewards = _rewards(conn, rollout_id)
    full = rebuild(turn_rows) if include_tokens or include_messages else {}
    turns = [_shown_turn(turn, full, tokens=include_tokens, messages=include_messages) for turn in turn_rows]
    return _shown_rollout(row, rewards, turns)


def _turn_rows(conn: Connection, rollout_id: str) -> Sequence[RowMapping]:
    """Every column of the rollout's turns, in order: the shown ones, and what `delta.rebuild` takes."""
    t = schema.turns
    return (
        conn.execute(select(t).where(t.c.rollout_id == rollout_id).order_by(t.c.turn_index)).mappings().all()
    )


def _rewards(conn: Connection, rollout_id: str) -> list[dict[str, Any]]:
    """Every reward posted for the rollout, in the order it was posted: a turn's and the rollout's alike."""
    w = schema.rewards
    rows = conn.execute(
        select(w.c.turn_index, w.c.value, w.c.components, w.c.created_at)
        .where(w.c.rollout_id == rollout_id)
        .order_by(w.c.reward_id)
    ).mappings()
    return [
        {name: reward[name] for name in ("turn_index", "value", "components", "created_at")}
        for reward in rows
    ]


def _shown_turn(
    turn: RowMapping, full: dict[int, FullTurn], *, tokens: bool, messages: bool
) -> dict[str, Any]:
    """A turn as the API shows it; its ids and its messages, the heavy part, only when asked for."""
    item: dict[str, Any] = {"index": turn["turn_index"]}
    item.update({name: turn[name] for name in SHOWN})
    item["latency_s"] = turn["finished_at"] - turn["started_at"]
    if tokens:
        item["prompt_token_ids"] = full[turn["turn_index"]].prompt_ids.tolist()
        item["completion_token_ids"] = unpack_ids(turn["completion_ids"]).tolist()
        item["completion_logprobs"] = unpack_logprobs(turn["completion_logprobs"]).tolist()
    if messages:
        item["messages"] = full[turn["turn_index"]].messages
        item["prompt_text"] = turn["prompt_text"]
        item["tools"] = turn["tools"]
        item["params"] = turn["params"]
        item["request"] = turn["request"]
    return item


def _shown_rollout(
    row: dict[str, Any], rewards: list[dict[str, Any]], turns: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "rollout_id": row["rollout_id"],
        "group_id": row["group_id"],
        "group_size": row["group_size"],
        "task_id": row["task_id"],
        "metadata": row["metadata"],
        "status": row["status"],
        "reward": row["reward"],
        "reward_components": row["reward_components"],
        "rewards": rewards,
        "created_at": row["created_at"],
        "finished_at": row["finished_at"],
        "claimed_by": row["claimed_by"],
        "claim_step": row["claim_step"],
        "skip_reason": row["skip_reason"],
        "lease_until": row["lease_until"],
        "mode": row["mode"],
        "tags": row["tags"],
        "limits": row["limits"],
        "sampling": row["sampling"],
        "policy": row["policy"],
        "backend": row["backend"],
        "end_reason": row["end_reason"],
        "turns": turns,
    }
