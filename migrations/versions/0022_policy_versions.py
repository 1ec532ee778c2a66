"""The run's policy versions in the order it published them (`policy_versions`): staleness is counted in
updates, not by comparing version strings.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "policy_versions",
        sa.Column("seq", BigId, primary_key=True, autoincrement=True),
        sa.Column("policy", sa.String(256)),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("published_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("policy_versions")
