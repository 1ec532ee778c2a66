"""Trainer claims on rollouts: claimed_by, claim_step, claimed_at, skip_reason.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("claimed_by", sa.String(128)))
        batch.add_column(sa.Column("claim_step", sa.Integer()))
        batch.add_column(sa.Column("claimed_at", sa.Float()))
        batch.add_column(sa.Column("skip_reason", sa.String(32)))
    op.create_index("ix_rollouts_claimed_by", "rollouts", ["claimed_by"])


def downgrade() -> None:
    op.drop_index("ix_rollouts_claimed_by", "rollouts")
    with op.batch_alter_table("rollouts") as batch:
        for column in ("skip_reason", "claimed_at", "claim_step", "claimed_by"):
            batch.drop_column(column)
