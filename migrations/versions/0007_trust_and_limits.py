"""Per-rollout keys and limits, SDK retries, several choices per call.

rollouts: `api_key_hash` (sha256 of the rollout's agent key; the key itself is never stored), `limits`
(max_turns, max_context_tokens) and `end_reason` (the limit that stopped the rollout's agent).
turns: `choice_index` (a call with n > 1 stores each choice as its own turn), `request_hash` (of the request
body) and `attempt` (the client's retry count) to recognise retries, and `retry_of` (the earlier turn a retry
repeats).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN: SQLite's batch mode would rebuild the table, which the views over it forbid.
    op.add_column("rollouts", sa.Column("api_key_hash", sa.String(64)))
    op.add_column("rollouts", sa.Column("limits", sa.JSON().with_variant(JSONB(), "postgresql")))
    op.add_column("rollouts", sa.Column("end_reason", sa.String(32)))
    op.add_column("turns", sa.Column("choice_index", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("turns", sa.Column("request_hash", sa.String(32)))
    op.add_column("turns", sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("turns", sa.Column("retry_of", sa.Integer()))


def downgrade() -> None:
    for name in ("retry_of", "attempt", "request_hash", "choice_index"):
        op.drop_column("turns", name)
    for name in ("end_reason", "limits", "api_key_hash"):
        op.drop_column("rollouts", name)
