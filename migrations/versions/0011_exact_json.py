"""What an agent and the engine exchanged is kept as sent on PostgreSQL too: turns.messages, tools, params,
tool_calls and request become `json` (kept as text) instead of `jsonb`, which reorders object keys, so that
a tool schema read back renders as the agent sent it. Rows written before keep the order jsonb gave them.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

COLUMNS = ("messages", "tools", "params", "tool_calls", "request")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":  # SQLite keeps JSON as text already
        for column in COLUMNS:
            op.execute(f"ALTER TABLE turns ALTER COLUMN {column} TYPE json USING {column}::json")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for column in COLUMNS:
            op.execute(f"ALTER TABLE turns ALTER COLUMN {column} TYPE jsonb USING {column}::jsonb")
