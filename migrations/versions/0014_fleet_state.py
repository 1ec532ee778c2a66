"""The fleet's state in the store: what every gateway process holds alike (the policy version, the pause,
the weight reloads and version, the servers with their draining flags and health), the history of weight
reloads, and the gateway's processes with their heartbeats; and an index of running rollouts by server, whose
counts place new rollouts. On PostgreSQL every process on every host follows these rows (changes are
announced with NOTIFY on `gateway_fleet`); a SQLite store has one process, which holds the fleet in memory.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "fleet",
        sa.Column("fleet_id", sa.Integer, nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("policy_version", sa.String(64), nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False),
        sa.Column("pause_mode", sa.String(8)),
        sa.Column("paused_by", sa.String(64)),
        sa.Column("reloads", sa.Integer, nullable=False),
        sa.Column("weight_version", sa.String(64)),
        sa.Column("changed_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("fleet_id", name="pk_fleet"),
    )
    op.create_table(
        "fleet_servers",
        sa.Column("url", sa.String(256), nullable=False),
        sa.Column("draining", sa.Boolean, nullable=False),
        sa.Column("healthy", sa.Boolean, nullable=False),
        sa.Column("models", _JSON, nullable=False),
        sa.Column("prefix_cache_hit_rate", sa.Float),
        sa.Column("reloads", sa.Integer, nullable=False),
        sa.Column("weight_version", sa.String(64)),
        sa.Column("added_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("url", name="pk_fleet_servers"),
    )
    op.create_table(
        "weight_reloads",
        sa.Column("reload", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("requested_by", sa.String(64)),
        sa.Column("at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("reload", name="pk_weight_reloads"),
    )
    op.create_table(
        "gateway_processes",
        sa.Column("process_id", sa.String(64), nullable=False),
        sa.Column("host", sa.String(256), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("port", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("applied_epoch", sa.BigInteger, nullable=False),
        sa.Column("in_flight", sa.Integer, nullable=False),
        sa.Column("waiting", sa.Integer, nullable=False),
        sa.Column("ended", sa.BigInteger, nullable=False),
        sa.Column("loads", _JSON),
        sa.Column("metrics", _JSON),
        sa.PrimaryKeyConstraint("process_id", name="pk_gateway_processes"),
    )

    # The store's count of running rollouts per server, read to place each new rollout.
    op.create_index(
        "ix_rollouts_running_backend",
        "rollouts",
        ["backend"],
        postgresql_where=sa.text("status = 'running'"),
        sqlite_where=sa.text("status = 'running'"),
    )


def downgrade() -> None:
    op.drop_index("ix_rollouts_running_backend", "rollouts")
    for table in ("gateway_processes", "weight_reloads", "fleet_servers", "fleet"):
        op.drop_table(table)
