"""Turn lineage and drift: forked_from, drift_tokens, and drift views per rollout, model and policy version.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# A turn with a parent either extends it exactly (drift_tokens = 0) or drifts; forks have no parent.
_COUNTS = """
    COUNT(*) AS turns,
    SUM(CASE WHEN parent_turn IS NOT NULL THEN 1 ELSE 0 END) AS extending_turns,
    SUM(CASE WHEN drift_tokens > 0 THEN 1 ELSE 0 END) AS drifted_turns,
    COALESCE(SUM(drift_tokens), 0) AS drift_tokens,
    SUM(CASE WHEN forked_from IS NOT NULL THEN 1 ELSE 0 END) AS forked_turns,
    CASE WHEN SUM(CASE WHEN parent_turn IS NOT NULL THEN 1 ELSE 0 END) = 0 THEN NULL
         ELSE 1.0 * SUM(CASE WHEN drift_tokens > 0 THEN 1 ELSE 0 END)
              / SUM(CASE WHEN parent_turn IS NOT NULL THEN 1 ELSE 0 END) END AS drift_rate
"""
VIEWS = {
    "drift_by_rollout": f"SELECT rollout_id, {_COUNTS} FROM turns GROUP BY rollout_id",
    "drift_by_model": f"SELECT model, {_COUNTS} FROM turns GROUP BY model",
    "drift_by_policy_version": f"SELECT policy_version, {_COUNTS} FROM turns GROUP BY policy_version",
}


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("forked_from", sa.Integer()))
        batch.add_column(sa.Column("drift_tokens", sa.Integer()))
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("drift_tokens")
        batch.drop_column("forked_from")
