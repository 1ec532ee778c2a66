"""Initial store: rollouts, turns, rewards and the analytics views.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import BYTEA, JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")
Blob = sa.LargeBinary().with_variant(BYTEA(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

VIEWS = {
    "rollout_stats": """
        SELECT r.rollout_id, r.group_id, r.task_id, r.status, r.reward,
               COUNT(t.turn_id) AS turns,
               COALESCE(SUM(CASE WHEN t.status = 'error' THEN 1 ELSE 0 END), 0) AS error_turns,
               COALESCE(SUM(CASE WHEN t.status = 'cancelled' THEN 1 ELSE 0 END), 0) AS cancelled_turns,
               COALESCE(SUM(t.prompt_tokens), 0) AS prompt_tokens,
               COALESCE(SUM(t.completion_tokens), 0) AS completion_tokens,
               r.created_at, r.finished_at,
               r.finished_at - r.created_at AS duration_s
        FROM rollouts r LEFT JOIN turns t ON t.rollout_id = r.rollout_id
        GROUP BY r.rollout_id, r.group_id, r.task_id, r.status, r.reward, r.created_at, r.finished_at
    """,
    "group_stats": """
        SELECT group_id, rollouts, finished, completed, rewarded, reward_mean,
               CASE WHEN reward_var IS NULL THEN NULL WHEN reward_var > 0 THEN sqrt(reward_var) ELSE 0.0 END
                   AS reward_std,
               reward_min, reward_max, first_created_at, last_finished_at
        FROM (
            SELECT group_id,
                   COUNT(*) AS rollouts,
                   SUM(CASE WHEN status <> 'running' THEN 1 ELSE 0 END) AS finished,
                   SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END) AS completed,
                   COUNT(reward) AS rewarded,
                   AVG(reward) AS reward_mean,
                   AVG(reward * reward) - AVG(reward) * AVG(reward) AS reward_var,
                   MIN(reward) AS reward_min,
                   MAX(reward) AS reward_max,
                   MIN(created_at) AS first_created_at,
                   MAX(finished_at) AS last_finished_at
            FROM rollouts
            GROUP BY group_id
        ) g
    """,
    "policy_version_stats": """
        SELECT v.policy_version,
               COUNT(*) AS rollouts,
               SUM(v.turns) AS turns,
               SUM(v.error_turns) AS error_turns,
               SUM(v.prompt_tokens) AS prompt_tokens,
               SUM(v.completion_tokens) AS completion_tokens,
               AVG(r.reward) AS reward_mean
        FROM (
            SELECT rollout_id, policy_version,
                   COUNT(*) AS turns,
                   SUM(CASE WHEN status = 'error' THEN 1 ELSE 0 END) AS error_turns,
                   SUM(prompt_tokens) AS prompt_tokens,
                   SUM(completion_tokens) AS completion_tokens
            FROM turns
            GROUP BY rollout_id, policy_version
        ) v JOIN rollouts r ON r.rollout_id = v.rollout_id
        GROUP BY v.policy_version
    """,
}


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("group_id", sa.String(128), nullable=False),
        sa.Column("task_id", sa.String(256)),
        sa.Column("metadata", Json, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reward", sa.Float()),
        sa.Column("reward_components", Json),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float()),
        sa.PrimaryKeyConstraint("rollout_id", name="pk_rollouts"),
    )
    op.create_index("ix_rollouts_group_id", "rollouts", ["group_id"])
    op.create_index("ix_rollouts_status", "rollouts", ["status"])
    op.create_table(
        "turns",
        sa.Column("turn_id", BigId, autoincrement=True, nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("turn_index", sa.Integer(), nullable=False),
        sa.Column("endpoint", sa.String(16), nullable=False),
        sa.Column("model", sa.String(256)),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text()),
        sa.Column("http_status", sa.Integer()),
        sa.Column("backend", sa.String(256)),
        sa.Column("policy_version", sa.String(64)),
        sa.Column("prefix_messages", sa.Integer(), nullable=False),
        sa.Column("messages", Json),
        sa.Column("prompt_text", sa.Text()),
        sa.Column("tools", Json),
        sa.Column("params", Json),
        sa.Column("content", sa.Text()),
        sa.Column("reasoning", sa.Text()),
        sa.Column("tool_calls", Json),
        sa.Column("finish_reason", sa.String(32)),
        sa.Column("parent_turn", sa.Integer()),
        sa.Column("prefix_tokens", sa.Integer(), nullable=False),
        sa.Column("prompt_ids", Blob, nullable=False),
        sa.Column("completion_ids", Blob, nullable=False),
        sa.Column("completion_logprobs", Blob, nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("first_token_at", sa.Float()),
        sa.Column("finished_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("turn_id", name="pk_turns"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.rollout_id"], name="fk_turns_rollout_id_rollouts"),
        sa.UniqueConstraint("rollout_id", "turn_index", name="uq_turns_rollout_id_turn_index"),
    )
    op.create_table(
        "rewards",
        sa.Column("reward_id", BigId, autoincrement=True, nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("turn_index", sa.Integer()),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("components", Json),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("reward_id", name="pk_rewards"),
        sa.ForeignKeyConstraint(
            ["rollout_id"], ["rollouts.rollout_id"], name="fk_rewards_rollout_id_rollouts"
        ),
    )
    op.create_index("ix_rewards_rollout_id", "rewards", ["rollout_id"])
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("rewards")
    op.drop_table("turns")
    op.drop_table("rollouts")
