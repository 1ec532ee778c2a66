"""Per-token weight versions: `fleet_servers.weight_spans`, whether a server's replies carry them (the
project's vLLM plugin; null until a health check asked). Turns keep the spans in `turns.weight_versions`,
which revision 0005 added.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fleet_servers") as batch:
        batch.add_column(sa.Column("weight_spans", sa.Boolean))


def downgrade() -> None:
    with op.batch_alter_table("fleet_servers") as batch:
        batch.drop_column("weight_spans")
