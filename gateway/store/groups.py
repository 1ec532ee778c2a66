"""Which GRPO groups are ready for training, which of their rollouts are trainable, and their advantages.

A group is ready when all its rollouts are finished, or when `group_timeout` seconds have passed since its
first rollout was created (then its finished rollouts are served and the unfinished ones are marked `late`).
A rollout is trainable when it finished `completed` or `truncated`, has a reward, is not stale, and had no
error or cancelled turn that the client did not retry (with `include_errors` such a rollout is kept, masked:
it counts in its group's statistics but carries no loss). Turns refused by a rollout limit end a trajectory
without spoiling it. A group with no trainable rollout is dropped, never served empty.
"""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import ColumnElement, and_, case, func, or_, select
from sqlalchemy.engine import Connection

from gateway.store import schema
from gateway.store.status import TRAINABLE, RolloutStatus, TurnStatus


@dataclass(frozen=True)
class SampleOptions:
    group_timeout: float | None = None
    """Serve a group's finished rollouts this many seconds after it started, even if others still run."""
    include_errors: bool = False
    """Keep rollouts with error or cancelled turns, with their loss masked."""
    normalize_std: bool = True
    """Divide by the group's reward std (GRPO); False gives the mean-centred variant."""
    epsilon: float = 1e-6
    current_version: int | None = None
    max_staleness: int | None = None
    """Skip rollouts whose oldest turn is more than this many policy versions behind `current_version`."""
    max_groups: int | None = None
    merged: bool = False
    """One sample per chain of turns that extend each other exactly, instead of one per turn."""


@dataclass
class RolloutInfo:
    rollout_id: str
    group_id: str
    status: str
    reward: float | None
    reward_components: dict[str, float] | None
    turns: int = 0
    bad_turns: int = 0
    versions: list[str] = field(default_factory=list)
    skip_reason: str | None = None
    masked: bool = False
    advantage: float = 0.0

    @property
    def oldest_version(self) -> int | None:
        numeric = [n for n in map(numeric_version, self.versions) if n is not None]
        return min(numeric) if numeric else None


_NUMERIC_VERSION = re.compile(r"-?[0-9]+")


def numeric_version(version: str | None) -> int | None:
    """A policy version as a number when it is one (ASCII digits, at most one leading minus), else None.

    `str.isdigit` is no test for this: it also accepts digits `int` refuses, such as "²"."""
    if version is None or _NUMERIC_VERSION.fullmatch(version) is None:
        return None
    return int(version)


@dataclass
class Selection:
    """Ready groups, split into what is served and what is skipped (with reasons), and counters."""

    served: dict[str, list[RolloutInfo]] = field(default_factory=dict)
    skipped: list[RolloutInfo] = field(default_factory=list)
    dropped_groups: list[str] = field(default_factory=list)

    @property
    def rollouts(self) -> list[RolloutInfo]:
        return [r for group in self.served.values() for r in group]

    def counts(self) -> dict[str, int]:
        reasons = Counter(r.skip_reason for r in self.skipped)
        served = self.rollouts
        return {
            "groups": len(self.served),
            "served_rollouts": len(served),
            "masked_rollouts": sum(r.masked for r in served),
            "dropped_groups": len(self.dropped_groups),
            **{f"skipped_{reason}": n for reason, n in sorted(reasons.items())},
        }


ROLLOUT_COLUMNS = (
    schema.rollouts.c.rollout_id,
    schema.rollouts.c.group_id,
    schema.rollouts.c.status,
    schema.rollouts.c.reward,
    schema.rollouts.c.reward_components,
)
"""What the selection reads of each rollout (`load_rollouts`)."""


def claimable(now: float) -> ColumnElement[bool]:
    """Not claimed, or claimed under a lease that ran out."""
    r = schema.rollouts
    return or_(r.c.claimed_by.is_(None), r.c.lease_until < now)


def ready_groups(
    conn: Connection, options: SampleOptions, *, unclaimed_only: bool, now: float | None = None
) -> list[str]:
    """Training groups ready to serve, oldest first (evaluation rollouts are never served)."""
    r = schema.rollouts
    now = now or time.time()
    running = func.sum(case((r.c.status == RolloutStatus.RUNNING, 1), else_=0))
    ready = running == 0
    if options.group_timeout is not None:
        ready = or_(ready, func.min(r.c.created_at) < now - options.group_timeout)
    query = select(r.c.group_id).where(r.c.eval.is_(False)).group_by(r.c.group_id)
    if unclaimed_only:
        unclaimed = func.sum(case((claimable(now), 1), else_=0))
        query = query.having(and_(unclaimed > 0, ready))
    else:
        query = query.having(ready)
    query = query.order_by(func.min(r.c.created_at))
    if options.max_groups is not None:
        query = query.limit(options.max_groups)
    return [row[0] for row in conn.execute(query)]


def load_rollouts(conn: Connection, rollout_rows: Sequence[Any]) -> list[RolloutInfo]:
    """RolloutInfo for rollout rows, with their turn counts and policy versions."""
    infos = {
        row.rollout_id: RolloutInfo(
            row.rollout_id, row.group_id, row.status, row.reward, row.reward_components
        )
        for row in rollout_rows
    }
    if not infos:
        return []
    t, retry = schema.turns, schema.turns.alias("retry")
    # A failed call counts unless the client retried it (the retry repeats it), and a call refused by a
    # rollout limit ended the agent's trajectory rather than spoiling it.
    retried = (
        select(retry.c.turn_id)
        .where(retry.c.rollout_id == t.c.rollout_id, retry.c.retry_of == t.c.turn_index)
        .exists()
    )
    failed = and_(t.c.status.not_in((TurnStatus.OK, TurnStatus.REFUSED)), ~retried)
    bad = func.sum(case((failed, 1), else_=0))
    per_version = conn.execute(
        select(t.c.rollout_id, t.c.policy_version, func.count(), bad)
        .where(t.c.rollout_id.in_(list(infos)))
        .group_by(t.c.rollout_id, t.c.policy_version)
    )
    for rollout_id, version, turns, bad_turns in per_version:
        info = infos[rollout_id]
        info.turns += turns
        info.bad_turns += int(bad_turns or 0)
        info.versions.append(version)
    return list(infos.values())


def classify(rollouts: list[RolloutInfo], options: SampleOptions) -> Selection:
    """Decide, group by group, what is served; compute the served rollouts' advantages."""
    selection = Selection()
    groups: dict[str, list[RolloutInfo]] = defaultdict(list)
    for info in rollouts:
        info.skip_reason = _skip_reason(info, options)
        info.masked = info.skip_reason is None and info.bad_turns > 0
        groups[info.group_id].append(info)
    for group_id, members in groups.items():
        trainable = [r for r in members if r.skip_reason is None]
        selection.skipped.extend(r for r in members if r.skip_reason is not None)
        if not trainable:
            selection.dropped_groups.append(group_id)
            continue
        rewards = [r.reward for r in trainable if r.reward is not None]
        for info, advantage in zip(trainable, advantages(rewards, options), strict=True):
            info.advantage = advantage
        selection.served[group_id] = trainable
    return selection


def advantages(rewards: Sequence[float], options: SampleOptions) -> list[float]:
    """GRPO advantages of one group's rewards: (reward - mean) / (std + epsilon), or only centred.

    Equal rewards teach nothing: they get exactly 0, even where their float mean is not one of them (three
    0.1s), which would leave centred values of about 1e-16 over a std of the same size (NaN with epsilon 0).
    """
    values = np.array(rewards, dtype=np.float64)
    if values.size == 0 or values.min() == values.max():
        return [0.0] * values.size
    centred = values - values.mean()
    scaled = centred / (values.std() + options.epsilon) if options.normalize_std else centred
    return [float(a) for a in scaled]


def _skip_reason(info: RolloutInfo, options: SampleOptions) -> str | None:
    if info.status == RolloutStatus.RUNNING:
        return "late"
    if info.status not in TRAINABLE:
        return "failed"
    if info.reward is None:
        return "no_reward"
    if info.turns == 0:
        return "no_turns"
    if info.bad_turns and not options.include_errors:
        return "error_turns"
    if options.current_version is not None and options.max_staleness is not None:
        oldest = info.oldest_version
        if oldest is not None and options.current_version - oldest > options.max_staleness:
            return "stale"
    return None


def read_groups(conn: Connection, groups: list[str], options: SampleOptions) -> Selection:
    """The given groups as a trainer would see them, claiming nothing: for export, analysis and the viewer."""
    r = schema.rollouts
    rows = conn.execute(select(*ROLLOUT_COLUMNS).where(r.c.group_id.in_(groups), r.c.eval.is_(False))).all()
    return classify(load_rollouts(conn, rows), options)
