"""What the viewer shows, read from the store. Fast on a large store: the page's rollouts are chosen first
(newest first, filtered, limited), and only their turns are aggregated."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, case, cast, func, select
from sqlalchemy.engine import Connection

from rollout_store import schema
from rollout_store.status import RolloutStatus, TurnStatus
from training_data.evaluation import evaluation_report
from training_data.groups import ROLLOUT_COLUMNS, RolloutInfo, SampleOptions, read_groups
from training_data.loading import load_samples

PAGE = 200
"""Rollouts per overview page."""


@dataclass(frozen=True)
class Filters:
    group: str | None = None
    tag: str | None = None
    status: str | None = None
    version: str | None = None
    """The policy version of the rollout's first turn."""


def rollouts(conn: Connection, filters: Filters, limit: int = PAGE) -> list[dict[str, Any]]:
    """The newest rollouts that pass `filters`, with their turn, token, error and drift counts."""
    r, t = schema.rollouts, schema.turns
    first = t.alias("first_turn")
    query = (
        select(
            r.c.rollout_id,
            r.c.group_id,
            r.c.group_size,
            r.c.task_id,
            r.c.status,
            r.c.reward,
            r.c.tags,
            r.c.eval,
            r.c.end_reason,
            r.c.created_at,
            r.c.finished_at,
            first.c.policy_version,
        )
        .join(first, (first.c.rollout_id == r.c.rollout_id) & (first.c.turn_index == 0), isouter=True)
        .order_by(r.c.created_at.desc())
        .limit(limit)
    )
    if filters.group:
        query = query.where(r.c.group_id == filters.group)
    if filters.status:
        query = query.where(r.c.status == filters.status)
    if filters.version:
        query = query.where(first.c.policy_version == filters.version)
    if filters.tag == "eval":
        query = query.where(r.c.eval.is_(True))
    elif filters.tag:  # tags are a JSON list of strings: the quoted tag in its text
        quoted = '"' + filters.tag.replace("\\", "\\\\").replace('"', '\\"') + '"'
        query = query.where(cast(r.c.tags, String).contains(quoted, autoescape=True))
    found = [dict(row._mapping) for row in conn.execute(query)]
    counts = _turn_counts(conn, [row["rollout_id"] for row in found])
    for row in found:
        row.update(counts.get(row["rollout_id"], _NO_TURNS))
    return found


_NO_TURNS = {"turns": 0, "prompt_tokens": 0, "completion_tokens": 0, "errors": 0, "drifted": 0, "forks": 0}


def _turn_counts(conn: Connection, rollout_ids: list[str]) -> dict[str, dict[str, int]]:
    if not rollout_ids:
        return {}
    t = schema.turns
    failed = t.c.status.in_([TurnStatus.ERROR, TurnStatus.CANCELLED])
    query = (
        select(
            t.c.rollout_id,
            func.count().label("turns"),
            func.coalesce(func.sum(t.c.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(t.c.completion_tokens), 0).label("completion_tokens"),
            func.sum(case((failed, 1), else_=0)).label("errors"),
            func.sum(case((t.c.drift_tokens > 0, 1), else_=0)).label("drifted"),
            func.sum(case((t.c.forked_from.is_not(None), 1), else_=0)).label("forks"),
        )
        .where(t.c.rollout_id.in_(rollout_ids))
        .group_by(t.c.rollout_id)
    )
    return {
        row.rollout_id: {key: int(value) for key, value in row._mapping.items() if key != "rollout_id"}
        for row in conn.execute(query)
    }


def reward_by_version(conn: Connection) -> dict[str, Any]:
    """Mean reward and pass@1 per policy version, of training and of evaluation rollouts, as
    `trainer-client eval` reports them."""
    return {
        "training": evaluation_report(conn, tagged_eval=False)["policy_versions"],
        "evaluation": evaluation_report(conn, tagged_eval=True)["policy_versions"],
    }


GROUP_LIMIT = 1000
"""Rollouts shown on a group page."""

TRAINER_DEFAULTS = SampleOptions()
"""How the viewer computes what trains: `trainer_client`'s defaults (GRPO advantages, error rollouts
skipped)."""


def group(conn: Connection, group_id: str) -> dict[str, Any] | None:
    """The group's rollouts in creation order with their counts, last reply, and what a trainer would make of
    them now: each one's advantage, or why it is skipped."""
    found = rollouts(conn, Filters(group=group_id), GROUP_LIMIT)
    if not found:
        return None
    found.reverse()
    selection = read_groups(conn, [group_id], TRAINER_DEFAULTS)
    infos = {info.rollout_id: info for info in selection.rollouts + selection.skipped}
    last = _last_replies(conn, [row["rollout_id"] for row in found])
    rewards: list[float] = []
    trained = 0
    for row in found:
        info = infos.get(row["rollout_id"])
        row["skip_reason"] = "eval" if info is None else info.skip_reason
        row["advantage"] = _rollout_advantage(info)
        row["choices"] = _choices(info)
        row["masked"] = info is not None and info.masked
        row["last_reply"] = last.get(row["rollout_id"])
        if row["skip_reason"] is None:  # it trains: its reward, or its choices' rewards, count in the mean
            trained += 1
            if row["advantage"] is not None:
                rewards.append(row["reward"])
            rewards.extend(choice["reward"] for choice in row["choices"])
    return {
        "group_id": group_id,
        "group_size": found[0]["group_size"],
        "waiting": _waiting(found),
        "rollouts": found,
        "trained": trained,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "normalized": TRAINER_DEFAULTS.normalize_std,
    }


def _waiting(members: list[dict[str, Any]]) -> dict[str, Any] | None:
    """For a group declared with a size whose members have not all been created and finished: how many
    have, and since when it waits (a trainer serves it only whole, or at its group timeout)."""
    size = members[0]["group_size"]
    finished = sum(member["status"] != RolloutStatus.RUNNING for member in members)
    if size is None or finished >= size:
        return None
    first = min(member["created_at"] for member in members)
    return {"created": len(members), "finished": finished, "age_s": round(time.time() - first, 1)}


def _rollout_advantage(info: RolloutInfo | None) -> float | None:
    """The advantage the rollout's reward gives its samples, if it trains with a reward of its own (a
    rollout may train on its choices' rewards alone)."""
    if info is None or info.skip_reason is not None or info.reward is None:
        return None
    return info.advantage


def _choices(info: RolloutInfo | None) -> list[dict[str, Any]]:
    """The choices rewarded one by one that train, each with its reward and advantage across its call."""
    outcomes = info.choice_outcomes if info is not None else {}
    return [
        {"turn_index": turn, "reward": reward, "advantage": advantage}
        for turn, (reward, advantage) in sorted(outcomes.items())
    ]


def _last_replies(conn: Connection, rollout_ids: list[str]) -> dict[str, str | None]:
    """The text each rollout's last turn answered (what its agent ended on)."""
    t = schema.turns
    last = (
        select(t.c.rollout_id, func.max(t.c.turn_index).label("turn_index"))
        .where(t.c.rollout_id.in_(rollout_ids))
        .group_by(t.c.rollout_id)
        .subquery()
    )
    query = select(t.c.rollout_id, t.c.content, t.c.tool_calls).join(
        last, (t.c.rollout_id == last.c.rollout_id) & (t.c.turn_index == last.c.turn_index)
    )
    return {row.rollout_id: row.content or _calls(row.tool_calls) for row in conn.execute(query)}


def _calls(tool_calls: list[dict[str, Any]] | None) -> str | None:
    """Tool calls as a harness would log them: name(arguments)."""
    if not tool_calls:
        return None
    shown = [
        f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments', '')})"
        for c in tool_calls
    ]
    return " ".join(shown)


def trainer_samples(conn: Connection, rollout_id: str) -> dict[str, Any] | None:
    """The rollout as `trainer_client` would train on it now: its merged samples (one per chain of turns that
    extend each other exactly) with loss mask, logprobs and advantage, or why it would be skipped."""
    r = schema.rollouts
    row = conn.execute(select(*ROLLOUT_COLUMNS).where(r.c.rollout_id == rollout_id)).first()
    if row is None:
        return None
    selection = read_groups(conn, [row.group_id], TRAINER_DEFAULTS)
    info = next((i for i in selection.rollouts + selection.skipped if i.rollout_id == rollout_id), None)
    if info is None:  # an evaluation rollout: never trained; its samples shown as they would be
        info = RolloutInfo(row.rollout_id, row.group_id, row.status, row.reward, row.reward_components)
        info.skip_reason = "eval"
    samples = load_samples(conn, [info], merged=True)
    return {
        "rollout_id": rollout_id,
        "group_id": row.group_id,
        "skip_reason": info.skip_reason,
        "advantage": _rollout_advantage(info),
        "samples": [sample.to_json() for sample in samples],
    }
