"""Exact mode: a rollout's capture mode, and how each turn's prompt was built (splice).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("mode", sa.String(16)))
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("splice", sa.String(128)))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("splice")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("mode")
