"""Which GRPO groups are ready for training, which of their rollouts are trainable, and their advantages.

A group is ready when all its rollouts are finished and, if it was declared with a size (`group_size`), when
that many have been created, so that an environment running a group a few members at a time does not have
its first members trained as a group of their own; or when `group_timeout` seconds have passed since its
first rollout was created (then its finished rollouts are served, with the count they have, and the
unfinished ones are marked `late`).
A rollout is trainable when it finished `completed` or `truncated`, has a reward, is not stale, and had no
error or cancelled turn that the client did not retry (with `include_errors` such a rollout is kept, masked:
it counts in its group's statistics but carries no loss). Turns refused by a rollout limit end a trajectory
without spoiling it. A group with no trainable rollout is dropped, never served empty.

**Choices rewarded one by one.** A call with `n > 1` is a GRPO group from one prompt: its choices are
stored as consecutive turns, `choice_index` 0..n-1, all copied from the call's one record (the same
`started_at`). When each of them has a turn-level reward (the latest posted for that turn), each trains with
its own reward and an advantage across the call's choices, by the same rule as a group's rollouts; the
rollout's other samples keep the rollout's reward and advantage. A rollout all of whose samples are such
choices trains without a rollout-level reward, and stays out of its group's statistics unless it has one.
"""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from sqlalchemy import ColumnElement, Select, and_, case, func, or_, select
from sqlalchemy.engine import Connection

from rollout_store import schema
from rollout_store.status import TRAINABLE, RolloutStatus, TurnStatus
from training_data.teacher_scores import unscored


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
    max_token_staleness: int | None = None
    """Keep the rollouts, but mask out of the loss the completion tokens sampled more than this many updates
    of their policy before `current_version` (`training_data.versions`): the tokens of a reply that a
    keep-mode update split, before the split."""
    max_groups: int | None = None
    merged: bool = False
    """One sample per chain of turns that extend each other exactly, instead of one per turn."""
    policy: str | None = None
    """Serve only the rollouts of groups that train this policy (`rollouts.policy`: a LoRA policy's name, or
    a model's); None: every policy's."""
    teacher: str | None = None
    """Serve only groups this teacher has scored wholly (`trainer-client score`), with its logprobs on every
    sample (`teacher_logprobs`)."""


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
    choice_rewards: list[dict[int, float]] = field(default_factory=list)
    """The n > 1 calls whose every choice has a turn reward: per call, each choice's turn -> its reward."""
    choices_cover: bool = False
    """Every sample of the rollout is one of those choices: it trains without a rollout-level reward."""
    turn_components: dict[int, dict[str, float] | None] = field(default_factory=dict)
    """The named parts of each of those choices' reward."""
    choice_outcomes: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Set by `classify` for a served rollout: each of those choices' turn -> (reward, advantage)."""

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
    declared = func.max(r.c.group_size)
    ready = and_(running == 0, or_(declared.is_(None), func.count() >= declared))
    if options.group_timeout is not None:
        ready = or_(ready, func.min(r.c.created_at) < now - options.group_timeout)
    query = select(r.c.group_id).where(r.c.eval.is_(False), *policy_is(options.policy)).group_by(r.c.group_id)
    if options.teacher is not None:
        query = query.where(r.c.group_id.not_in(_groups_to_score(options.teacher)))
    if unclaimed_only:
        unclaimed = func.sum(case((claimable(now), 1), else_=0))
        query = query.having(and_(unclaimed > 0, ready))
    else:
        query = query.having(ready)
    query = query.order_by(func.min(r.c.created_at))
    if options.max_groups is not None:
        query = query.limit(options.max_groups)
    return [row[0] for row in conn.execute(query)]


def policy_is(policy: str | None) -> tuple[ColumnElement[bool], ...]:
    """The condition on rollouts that serves `policy`'s alone (none for every policy)."""
    return () if policy is None else (schema.rollouts.c.policy == policy,)


def _groups_to_score(teacher: str) -> Select[tuple[str]]:
    """Groups with a finished rollout that has turns `teacher` has not scored."""
    r, t = schema.rollouts, schema.turns
    return (
        select(r.c.group_id)
        .join(t, t.c.rollout_id == r.c.rollout_id)
        .where(r.c.status != RolloutStatus.RUNNING, unscored(teacher))
    )


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
    _load_rewarded_choices(conn, infos)
    return list(infos.values())


class TurnOutline(NamedTuple):
    """What finding a rollout's rewarded choices needs of a stored turn."""

    turn_index: int
    choice_index: int
    started_at: float
    sampled: bool
    """It sampled ids: it is a training sample."""


def choice_calls(turns: Sequence[TurnOutline]) -> list[list[int]]:
    """The turn indexes of each call with several choices, from a rollout's turns in order.

    A call's choices are consecutive turns (they commit together) copied from one record: the same start,
    their choice index rising. A call of one choice, or one that recorded a single choice, is no comparison.
    """
    calls: list[list[TurnOutline]] = []
    for turn in turns:
        last = calls[-1][-1] if calls else None
        if last and turn.started_at == last.started_at and turn.choice_index > last.choice_index:
            calls[-1].append(turn)
        else:
            calls.append([turn])
    return [[turn.turn_index for turn in call] for call in calls if len(call) > 1]


def rewarded_choices(
    turns: Sequence[TurnOutline], turn_rewards: Mapping[int, float]
) -> tuple[list[dict[int, float]], bool]:
    """The calls whose every choice has a turn reward (per call, each choice's turn -> its reward), and
    whether those choices hold every sample of the rollout."""
    calls = [
        {turn: turn_rewards[turn] for turn in call}
        for call in choice_calls(turns)
        if all(turn in turn_rewards for turn in call)
    ]
    chosen = {turn for call in calls for turn in call}
    return calls, bool(calls) and all(t.turn_index in chosen for t in turns if t.sampled)


def _load_rewarded_choices(conn: Connection, infos: dict[str, RolloutInfo]) -> None:
    """Fill in the rewarded choices of the rollouts with turn rewards (of each turn the latest counts, as the
    latest rollout reward does); the turns of the others are not read."""
    t, w = schema.turns, schema.rewards
    latest = (
        select(func.max(w.c.reward_id))
        .where(w.c.rollout_id.in_(list(infos)), w.c.turn_index.is_not(None))
        .group_by(w.c.rollout_id, w.c.turn_index)
    )
    turn_rewards: dict[str, dict[int, float]] = defaultdict(dict)
    for rollout_id, turn_index, value, components in conn.execute(
        select(w.c.rollout_id, w.c.turn_index, w.c.value, w.c.components).where(w.c.reward_id.in_(latest))
    ):
        turn_rewards[rollout_id][turn_index] = value
        infos[rollout_id].turn_components[turn_index] = components
    if not turn_rewards:
        return
    turns: dict[str, list[TurnOutline]] = defaultdict(list)
    for rollout_id, *outline in conn.execute(
        select(t.c.rollout_id, t.c.turn_index, t.c.choice_index, t.c.started_at, t.c.completion_tokens > 0)
        .where(t.c.rollout_id.in_(list(turn_rewards)))
        .order_by(t.c.rollout_id, t.c.turn_index)
    ):
        turns[rollout_id].append(TurnOutline(*outline))
    for rollout_id, rewards in turn_rewards.items():
        infos[rollout_id].choice_rewards, infos[rollout_id].choices_cover = rewarded_choices(
            turns[rollout_id], rewards
        )


def classify(rollouts: list[RolloutInfo], options: SampleOptions) -> Selection:
    """Decide, group by group, what is served; compute the served rollouts' advantages."""
    selection = Selection()
    groups: dict[str, list[RolloutInfo]] = defaultdict(list)
    for info in rollouts:
        info.skip_reason = _skip_reason(info, options)
        info.masked = info.skip_reason is None and info.bad_turns > 0
        info.advantage, info.choice_outcomes = 0.0, {}
        groups[info.group_id].append(info)
    for group_id, members in groups.items():
        trainable = [r for r in members if r.skip_reason is None]
        selection.skipped.extend(r for r in members if r.skip_reason is not None)
        if not trainable:
            selection.dropped_groups.append(group_id)
            continue
        rewarded = [(info, info.reward) for info in trainable if info.reward is not None]
        scores = advantages([reward for _, reward in rewarded], options)
        for (info, _), advantage in zip(rewarded, scores, strict=True):
            info.advantage = advantage
        for info in trainable:
            info.choice_outcomes = _choice_outcomes(info.choice_rewards, options)
        selection.served[group_id] = trainable
    return selection


def _choice_outcomes(calls: list[dict[int, float]], options: SampleOptions) -> dict[int, tuple[float, float]]:
    """Each rewarded choice's turn -> (its reward, its advantage across its call's choices)."""
    return {
        turn: (reward, advantage)
        for call in calls
        for (turn, reward), advantage in zip(
            call.items(), advantages(list(call.values()), options), strict=True
        )
    }


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
    if info.reward is None and not info.choices_cover:
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
