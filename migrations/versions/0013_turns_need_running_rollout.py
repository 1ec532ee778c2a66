"""A turn is only ever stored in a running rollout, whichever process writes it.

A gateway process remembers the state of the rollouts it writes so that a turn costs one INSERT; another
replica (or another `--workers` process) can finish such a rollout meanwhile. The database itself now refuses
the turn: the insert checks the rollout is running, and on PostgreSQL holds a share lock on its row until the
turn commits, so a finish waits for the turns already being written and no turn lands after it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_POSTGRESQL = """
CREATE FUNCTION turn_needs_running_rollout() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM rollouts WHERE rollout_id = NEW.rollout_id AND status = 'running' FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'rollout % is not running', NEW.rollout_id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER turns_need_running_rollout BEFORE INSERT ON turns
    FOR EACH ROW EXECUTE FUNCTION turn_needs_running_rollout();
"""

_SQLITE = """
CREATE TRIGGER turns_need_running_rollout BEFORE INSERT ON turns
WHEN (SELECT status FROM rollouts WHERE rollout_id = NEW.rollout_id) IS NOT 'running'
BEGIN
    SELECT RAISE(ABORT, 'the rollout is not running');
END
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_POSTGRESQL)
    else:
        op.execute(_SQLITE)


def downgrade() -> None:
    op.execute("DROP TRIGGER turns_need_running_rollout" + _ON_TURNS[op.get_bind().dialect.name])
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION turn_needs_running_rollout()")


_ON_TURNS = {"postgresql": " ON turns", "sqlite": ""}
