"""Groups with a declared size: `rollouts.group_size` holds how many members the group was created with
(`POST /rollouts {"group_size": N}`; every member carries its group's size), and `group_stats` shows it.

A group with a declared size is served to trainers only once that many members have finished: an environment
that runs a group's members a few at a time no longer has the first ones trained as a group of their own.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_GROUP_STATS = """
    SELECT group_id, group_size, rollouts, finished, completed, rewarded, reward_mean,
           CASE WHEN reward_var IS NULL THEN NULL WHEN reward_var > 0 THEN sqrt(reward_var) ELSE 0.0 END
               AS reward_std,
           reward_min, reward_max, first_created_at, last_finished_at
    FROM (
        SELECT group_id,
               MAX(group_size) AS group_size,
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
"""

_OLD_GROUP_STATS = """
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
"""


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("group_size", sa.Integer()))
    op.execute("DROP VIEW group_stats")
    op.execute(f"CREATE VIEW group_stats AS {_GROUP_STATS}")


def downgrade() -> None:
    op.execute("DROP VIEW group_stats")
    op.execute(f"CREATE VIEW group_stats AS {_OLD_GROUP_STATS}")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("group_size")
