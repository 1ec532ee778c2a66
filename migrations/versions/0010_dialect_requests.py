"""Agent dialects: turns.request, the agent's own request when it spoke another dialect than chat (Messages,
Responses) without its conversation, and turns.response_id, the Responses API id that previous_response_id
and GET .../responses/{id} find the turn by.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN: SQLite's batch mode would rebuild the table, which the views over it forbid.
    op.add_column("turns", sa.Column("request", sa.JSON().with_variant(JSONB(), "postgresql")))
    op.add_column("turns", sa.Column("response_id", sa.String(64)))
    op.create_index("ix_turns_response_id", "turns", ["response_id"])


def downgrade() -> None:
    op.drop_index("ix_turns_response_id", "turns")
    op.drop_column("turns", "response_id")
    op.drop_column("turns", "request")
