"""Evaluation: mean reward and pass@k of the rollouts tagged `eval`, per policy version.

An evaluation rollout belongs to the policy version its first turn was sampled with. pass@k is the unbiased
estimator of Chen et al. (2021): for a task sampled n times with c passes, 1 - C(n - c, k) / C(n, k), averaged
over the version's tasks that have at least k samples.
"""

from __future__ import annotations

from collections import defaultdict
from math import comb
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from rollout_store import schema
from rollout_store.status import TRAINABLE, RolloutStatus
from training_data.groups import numeric_version


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluation_report(
    conn: Connection, ks: tuple[int, ...] = (1,), pass_threshold: float = 1.0, *, tagged_eval: bool = True
) -> dict[str, Any]:
    """Per policy version: rollouts, tasks, mean reward and pass@k, oldest version first.

    The rollouts tagged `eval`, or with `tagged_eval=False` the training rollouts (to follow learning). Those
    that finished `completed` or `truncated` with a reward make the mean; those that finished otherwise
    (`failed`, `aborted`, or without a reward) are counted as `failed` and as samples that did not pass.
    """
    r, t = schema.rollouts, schema.turns
    rows = conn.execute(
        select(r.c.task_id, r.c.status, r.c.reward, t.c.policy_version)
        .join(t, (t.c.rollout_id == r.c.rollout_id) & (t.c.turn_index == 0), isouter=True)
        .where(r.c.eval.is_(tagged_eval), r.c.status != RolloutStatus.RUNNING)
    ).all()
    by_version: dict[str | None, dict[str | None, list[float | None]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for task_id, status, reward, version in rows:
        scored = status in TRAINABLE and reward is not None
        by_version[version][task_id].append(reward if scored else None)
    versions = [_version_report(version, tasks, ks, pass_threshold) for version, tasks in by_version.items()]
    versions.sort(key=lambda v: _version_order(v["policy_version"]))
    return {"pass_threshold": pass_threshold, "k": list(ks), "policy_versions": versions}


def _version_report(
    version: str | None, tasks: dict[str | None, list[float | None]], ks: tuple[int, ...], threshold: float
) -> dict[str, Any]:
    """`None` in `tasks` stands for a rollout that failed."""
    samples = [reward for rewards in tasks.values() for reward in rewards]
    rewards = [reward for reward in samples if reward is not None]
    report: dict[str, Any] = {
        "policy_version": version,
        "rollouts": len(samples),
        "failed": len(samples) - len(rewards),
        "tasks": len(tasks),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
    }
    for k in ks:
        scores = [
            pass_at_k(len(runs), sum(reward is not None and reward >= threshold for reward in runs), k)
            for runs in tasks.values()
            if len(runs) >= k
        ]
        report[f"pass@{k}"] = sum(scores) / len(scores) if scores else None
    return report


def _version_order(version: str | None) -> tuple[int, int | str]:
    """Numeric versions in numeric order, then the others by name, then turns without a version."""
    if version is None:
        return (2, "")
    number = numeric_version(version)
    return (0, number) if number is not None else (1, version)
