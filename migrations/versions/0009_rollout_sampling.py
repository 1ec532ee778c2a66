"""Trainer-controlled sampling: rollouts.sampling, the vLLM sampling fields imposed on every call of the
rollout (null: the gateway's --sampling).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN: SQLite's batch mode would rebuild the table, which the views over it forbid.
    op.add_column("rollouts", sa.Column("sampling", sa.JSON().with_variant(JSONB(), "postgresql")))


def downgrade() -> None:
    op.drop_column("rollouts", "sampling")
