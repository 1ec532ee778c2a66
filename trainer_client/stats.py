"""Store-wide statistics for `trainer-client stats`, in plain SQL over the gateway's tables and views.

Drift: a turn that extends an earlier one (`parent_turn`) drifts when its prompt does not reproduce that
turn's exact prompt + completion ids (`drift_tokens > 0`): training on it would train on re-rendered tokens.
Splices: per model, how exact mode built the prompts of turns extending an earlier one (spliced onto the
parent's ids, re-rendered because the template moved earlier context, or a fallback), and why the rest did
not splice.
Policies: the rollouts of each policy (`rollouts.policy`: declared, else its first call's model), and the
turns each LoRA adapter version sampled.
Groups: a group declared with a size (`group_size`) waits until that many members have finished, one without
a size while any member runs; the oldest groups still waiting, of either kind, are listed with their age and
counts (the same groups the `groups` table counts as waiting), since one that never completes is served only
by a trainer's `group_timeout`.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

WAITING_SHOWN = 20
"""The oldest groups not yet complete that `stats` lists."""
COMPLETE_GROUP = "finished = COALESCE(group_size, rollouts) AND rollouts >= COALESCE(group_size, rollouts)"
"""A group whose members have all finished, and all been created if it was declared with a size (`stats`,
`tail`)."""

QUERIES = {
    "rollouts": "SELECT status, COUNT(*) AS rollouts FROM rollouts GROUP BY status ORDER BY status",
    "groups": f"""
        SELECT COUNT(*) AS groups,
               SUM(CASE WHEN {COMPLETE_GROUP} THEN 1 ELSE 0 END) AS complete,
               SUM(CASE WHEN {COMPLETE_GROUP} THEN 0 ELSE 1 END) AS waiting
        FROM group_stats
    """,
    "waiting_groups": f"""
        SELECT group_id, group_size, rollouts AS created, finished, first_created_at
        FROM group_stats WHERE NOT ({COMPLETE_GROUP})
        ORDER BY first_created_at, group_id LIMIT {WAITING_SHOWN}
    """,
    "policies": """
        SELECT policy, COUNT(*) AS rollouts, SUM(CASE WHEN status <> 'running' THEN 1 ELSE 0 END) AS finished,
               SUM(CASE WHEN status <> 'running' AND claimed_by IS NULL AND NOT eval THEN 1 ELSE 0 END)
                   AS unclaimed,
               AVG(reward) AS mean_reward
        FROM rollouts GROUP BY policy ORDER BY policy
    """,
    "adapter_versions": """
        SELECT model AS policy, policy_version AS version, adapter, COUNT(DISTINCT rollout_id) AS rollouts,
               COUNT(*) AS turns, SUM(completion_tokens) AS completion_tokens
        FROM turns WHERE adapter IS NOT NULL
        GROUP BY model, policy_version, adapter ORDER BY model, MIN(turn_id)
    """,
    "turns": """
        SELECT status, COUNT(*) AS turns, SUM(prompt_tokens) AS prompt_tokens,
               SUM(completion_tokens) AS completion_tokens
        FROM turns GROUP BY status ORDER BY status
    """,
    "rewards": """
        SELECT COUNT(reward) AS rewarded, AVG(reward) AS mean,
               CASE WHEN AVG(reward * reward) - AVG(reward) * AVG(reward) > 0
                    THEN sqrt(AVG(reward * reward) - AVG(reward) * AVG(reward)) ELSE 0.0 END AS std,
               MIN(reward) AS min, MAX(reward) AS max
        FROM rollouts WHERE status <> 'running'
    """,
    "claims": """
        SELECT CASE WHEN eval THEN 'evaluation'
                    WHEN claimed_by IS NULL THEN 'unclaimed'
                    WHEN skip_reason IS NOT NULL THEN 'skipped: ' || skip_reason
                    WHEN lease_until IS NOT NULL THEN 'leased'
                    ELSE 'trained' END AS state,
               COUNT(*) AS rollouts
        FROM rollouts WHERE status <> 'running' OR claimed_by IS NOT NULL
        GROUP BY 1 ORDER BY 1
    """,
    "policy_versions": """
        SELECT t.policy_version, COUNT(DISTINCT t.rollout_id) AS rollouts, COUNT(*) AS turns,
               SUM(CASE WHEN t.status <> 'ok' THEN 1 ELSE 0 END) AS error_turns,
               SUM(t.completion_tokens) AS completion_tokens,
               d.extending_turns, d.drifted_turns, d.drift_rate, d.forked_turns
        FROM turns t JOIN drift_by_policy_version d ON d.policy_version = t.policy_version
        GROUP BY t.policy_version, d.extending_turns, d.drifted_turns, d.drift_rate, d.forked_turns
        ORDER BY t.policy_version
    """,
    "splices": """
        SELECT model, boundaries, spliced, re_rendered, fallbacks, splice_rate
        FROM splice_by_model ORDER BY model
    """,
    "splice_outcomes": """
        SELECT model, splice, turns FROM splice_outcomes WHERE splice <> 'exact'
        ORDER BY model, turns DESC, splice
    """,
}


def collect(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    report = {name: [dict(row._mapping) for row in conn.execute(text(sql))] for name, sql in QUERIES.items()}
    now = time.time()
    for group in report["waiting_groups"]:  # a group that waits long is one whose members never all came
        group["age_s"] = round(now - group.pop("first_created_at"), 1)
    return report
