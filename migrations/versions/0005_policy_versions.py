"""Policy versions at a turn's end, and vLLM's per-token weight-version spans (exact mode).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("policy_version_end", sa.String(64)))
        batch.add_column(sa.Column("weight_versions", sa.JSON().with_variant(JSONB(), "postgresql")))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("weight_versions")
        batch.drop_column("policy_version_end")
