"""The `fleet` table becomes `run_state`: it holds what every gateway process holds alike (the pause, the
policy version, the weights), while "fleet" names the vLLM servers alone (`fleet_servers`). Changes are
announced on `gateway_run_state`.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    _rename("fleet", "run_state")


def downgrade() -> None:
    _rename("run_state", "fleet")


def _rename(before: str, after: str) -> None:
    op.rename_table(before, after)
    with op.batch_alter_table(after) as batch:
        batch.alter_column(f"{before}_id", new_column_name=f"{after}_id")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {after} RENAME CONSTRAINT pk_{before} TO pk_{after}")
