"""Which weights sampled each token, in SQL: `token_versions` (one row per span of a sampled turn's tokens:
its spans from a server with the vLLM plugin, else every token at the version the call was dispatched at, and
an adapter's turn at its adapter version), `version_order` (each policy's versions numbered from 0 in the
order the run published them) and `staleness_by_step` (per training step, the tokens of the rollouts claimed
at it by how many of their policy's versions had been published after theirs when the claim was made).

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-29
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

# A span's fields, and whether a turn has spans at all: JSON is read differently by each database.
_SQLITE = {
    "spans": "json_each(t.weight_versions) s",
    "version": "json_extract(s.value, '$.version')",
    "start": "json_extract(s.value, '$.start')",
    "end": "json_extract(s.value, '$.end')",
    "is_array": "json_type(t.weight_versions) = 'array'",
}
_POSTGRESQL = {
    # (the function is called on every row, whatever the WHERE clause: a turn without spans gives it none)
    "spans": "jsonb_array_elements(CASE WHEN jsonb_typeof(t.weight_versions) = 'array' "
    "THEN t.weight_versions ELSE '[]'::jsonb END) s(value)",
    "version": "s.value->>'version'",
    "start": "CAST(s.value->>'start' AS INTEGER)",
    "end": "CAST(s.value->>'end' AS INTEGER)",
    "is_array": "jsonb_typeof(t.weight_versions) = 'array'",
}

_TOKEN_VERSIONS = """
    SELECT t.turn_id, t.rollout_id, t.turn_index, NULL AS policy, {version} AS version,
           {start} AS start_token, {end} AS end_token, {end} - {start} AS tokens
    FROM turns t, {spans}
    WHERE t.adapter IS NULL AND t.completion_tokens > 0 AND {is_array}
    UNION ALL
    SELECT t.turn_id, t.rollout_id, t.turn_index, CASE WHEN t.adapter IS NOT NULL THEN t.model END,
           t.policy_version, 0, t.completion_tokens, t.completion_tokens
    FROM turns t
    WHERE t.completion_tokens > 0 AND (t.adapter IS NOT NULL OR NOT COALESCE({is_array}, FALSE))
"""

_VERSION_ORDER = """
    SELECT f.policy, f.version, f.published_at,
           (SELECT COUNT(*)
            FROM (SELECT policy, MIN(seq) AS first_seq FROM policy_versions GROUP BY policy, version) o
            WHERE o.first_seq < f.first_seq
                AND (o.policy = f.policy OR (o.policy IS NULL AND f.policy IS NULL))) AS version_index
    FROM (SELECT policy, version, MIN(seq) AS first_seq, MIN(published_at) AS published_at
          FROM policy_versions GROUP BY policy, version) f
"""

_SAME_POLICY = "({a}.policy = {b}.policy OR ({a}.policy IS NULL AND {b}.policy IS NULL))"

_STALENESS_BY_STEP = f"""
    SELECT r.claim_step AS step, now.version_index - v.version_index AS staleness,
           COUNT(DISTINCT s.turn_id) AS turns, SUM(s.tokens) AS tokens
    FROM token_versions s
    JOIN rollouts r ON r.rollout_id = s.rollout_id
    JOIN version_order v ON v.version = s.version AND {_SAME_POLICY.format(a="v", b="s")}
    JOIN version_order now ON {_SAME_POLICY.format(a="now", b="s")}
        AND now.version_index = (
            SELECT MAX(c.version_index) FROM version_order c
            WHERE {_SAME_POLICY.format(a="c", b="s")} AND c.published_at <= r.claimed_at
        )
    WHERE r.claim_step IS NOT NULL
    GROUP BY r.claim_step, now.version_index - v.version_index
"""


def upgrade() -> None:
    fields = _SQLITE if op.get_bind().dialect.name == "sqlite" else _POSTGRESQL
    op.execute("CREATE VIEW token_versions AS " + _TOKEN_VERSIONS.format(**fields))
    op.execute("CREATE VIEW version_order AS " + _VERSION_ORDER)
    op.execute("CREATE VIEW staleness_by_step AS " + _STALENESS_BY_STEP)


def downgrade() -> None:
    for view in ("staleness_by_step", "version_order", "token_versions"):
        op.execute(f"DROP VIEW {view}")
