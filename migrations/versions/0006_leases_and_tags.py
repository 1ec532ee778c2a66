"""Claim leases (a trainer that dies gives its rollouts back) and rollout tags (eval rollouts).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN: SQLite's batch mode would rebuild the table, which the views over it forbid.
    op.add_column("rollouts", sa.Column("lease_until", sa.Float()))
    op.add_column("rollouts", sa.Column("tags", sa.JSON().with_variant(JSONB(), "postgresql")))
    op.add_column("rollouts", sa.Column("eval", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    for name in ("eval", "tags", "lease_until"):
        op.drop_column("rollouts", name)
