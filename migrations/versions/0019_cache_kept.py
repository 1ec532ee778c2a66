"""Weight updates that keep the servers' caches: `run_state.cache_kept` holds whether the last pause kept
vLLM's KV and prefix caches (`POST /admin/pause {"clear_cache": false}`), and `turns.cache_kept` whether a
turn that spanned a weight update went on with keys and values the previous weights computed (true) or was
computed again with the new ones (false); null for a turn that spanned no update.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("run_state") as batch:
        batch.add_column(sa.Column("cache_kept", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("cache_kept", sa.Boolean()))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("cache_kept")
    with op.batch_alter_table("run_state") as batch:
        batch.drop_column("cache_kept")
