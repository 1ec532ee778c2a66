"""A fleet of vLLM servers: rollouts.backend, the server a rollout is pinned to (every gateway replica routes
its calls there), and turns.repinned_from, the server a turn's rollout left because it failed or was drained
or removed.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN: SQLite's batch mode would rebuild the table, which the views over it forbid.
    op.add_column("rollouts", sa.Column("backend", sa.String(256)))
    op.add_column("turns", sa.Column("repinned_from", sa.String(256)))


def downgrade() -> None:
    op.drop_column("turns", "repinned_from")
    op.drop_column("rollouts", "backend")
