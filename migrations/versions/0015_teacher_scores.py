"""Teacher scores for on-policy distillation: `teacher_scores`, a teacher's logprob of every sampled token of
a turn (packed little-endian float32, aligned with `turns.completion_ids`), per turn and teacher name, with
the version of the weights that scored it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import BYTEA

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_BLOB = sa.LargeBinary().with_variant(BYTEA(), "postgresql")
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "teacher_scores",
        sa.Column("turn_id", _BIG_ID, nullable=False),
        sa.Column("teacher", sa.String(128), nullable=False),
        sa.Column("teacher_version", sa.String(256), nullable=False),
        sa.Column("logprobs", _BLOB, nullable=False),
        sa.Column("scored_at", sa.Float, nullable=False),
        sa.ForeignKeyConstraint(["turn_id"], ["turns.turn_id"], name="fk_teacher_scores_turn_id_turns"),
        sa.PrimaryKeyConstraint("turn_id", "teacher", name="pk_teacher_scores"),
    )


def downgrade() -> None:
    op.drop_table("teacher_scores")
