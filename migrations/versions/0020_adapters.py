"""LoRA policies: `run_state.adapters` holds the versions the servers hold (published with POST
/admin/adapters), `fleet_servers.adapter_errors` the versions a server failed to load,
`gateway_processes.adapter_holds` each process's calls in flight on each version, and `turns.adapter` the
adapter version that sampled a turn (null for a model's own weights); `rollouts.policy` the policy a rollout
trains (declared, else its first call's model), by which trainers claim.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("run_state") as batch:
        batch.add_column(sa.Column("adapters", Json))
    with op.batch_alter_table("fleet_servers") as batch:
        batch.add_column(sa.Column("adapter_errors", Json))
    with op.batch_alter_table("gateway_processes") as batch:
        batch.add_column(sa.Column("adapter_holds", Json))
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("adapter", sa.String(160)))
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("policy", sa.String(256)))


def downgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("policy")
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("adapter")
    with op.batch_alter_table("gateway_processes") as batch:
        batch.drop_column("adapter_holds")
    with op.batch_alter_table("fleet_servers") as batch:
        batch.drop_column("adapter_errors")
    with op.batch_alter_table("run_state") as batch:
        batch.drop_column("adapters")
