"""Store-wide statistics for `trainer-client stats`, in plain SQL over the gateway's tables and views."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

# A turn drifts when it has a parent but its prompt does not start with the parent's whole prompt + completion:
# the re-rendered history differs, at the token level, from what the model saw and sampled.
_DRIFT = "CASE WHEN t.parent_turn IS NOT NULL AND t.prefix_tokens < p.prompt_tokens + p.completion_tokens THEN 1 ELSE 0 END"

QUERIES = {
    "rollouts": "SELECT status, COUNT(*) AS rollouts FROM rollouts GROUP BY status ORDER BY status",
    "groups": """
        SELECT COUNT(*) AS groups,
               SUM(CASE WHEN finished = rollouts THEN 1 ELSE 0 END) AS complete,
               SUM(CASE WHEN finished < rollouts THEN 1 ELSE 0 END) AS waiting
        FROM group_stats
    """,
    "turns": """
        SELECT t.status, COUNT(*) AS turns, SUM(t.prompt_tokens) AS prompt_tokens,
               SUM(t.completion_tokens) AS completion_tokens, SUM(""" + _DRIFT + """) AS drift_turns
        FROM turns t LEFT JOIN turns p ON p.rollout_id = t.rollout_id AND p.turn_index = t.parent_turn
        GROUP BY t.status ORDER BY t.status
    """,
    "rewards": """
        SELECT COUNT(reward) AS rewarded, AVG(reward) AS mean,
               CASE WHEN AVG(reward * reward) - AVG(reward) * AVG(reward) > 0
                    THEN sqrt(AVG(reward * reward) - AVG(reward) * AVG(reward)) ELSE 0.0 END AS std,
               MIN(reward) AS min, MAX(reward) AS max
        FROM rollouts WHERE status <> 'running'
    """,
    "claims": """
        SELECT CASE WHEN claimed_by IS NULL THEN 'unclaimed'
                    WHEN skip_reason IS NULL THEN 'trained'
                    ELSE 'skipped: ' || skip_reason END AS state,
               COUNT(*) AS rollouts
        FROM rollouts WHERE status <> 'running' OR claimed_by IS NOT NULL
        GROUP BY 1 ORDER BY 1
    """,
    "policy_versions": """
        SELECT t.policy_version, COUNT(DISTINCT t.rollout_id) AS rollouts, COUNT(*) AS turns,
               SUM(CASE WHEN t.status <> 'ok' THEN 1 ELSE 0 END) AS error_turns,
               SUM(""" + _DRIFT + """) AS drift_turns,
               SUM(t.completion_tokens) AS completion_tokens
        FROM turns t LEFT JOIN turns p ON p.rollout_id = t.rollout_id AND p.turn_index = t.parent_turn
        GROUP BY t.policy_version ORDER BY t.policy_version
    """,
}


def collect(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    return {name: [dict(row._mapping) for row in conn.execute(text(sql))] for name, sql in QUERIES.items()}
