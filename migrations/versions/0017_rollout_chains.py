"""A rollout's chains: the paths of its lineage tree that train as one merged sample each, as
`training_data.samples.merge_steps` draws them. A sampled turn continues its parent's chain when it extends the
parent exactly (its prompt starts with all of the parent's prompt and completion ids: `prefix_tokens` counts
them) and is the first turn to do so; neither may stand alone (a choice of an `n > 1` call rewarded on its
own, or an attempt a client retried). Every other sampled turn starts a chain.

`chain_turns` has one row per sampled turn: its chain (the chain's first turn), its position in it, the
chain's turns so far and their sampled tokens. `rollout_chains` has one row per chain.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_CHAIN_TURNS = """
WITH RECURSIVE
rewarded_choices AS (
    SELECT t.rollout_id, t.turn_index
    FROM turns t
    WHERE EXISTS (
        SELECT 1 FROM turns other
        WHERE other.rollout_id = t.rollout_id AND other.started_at = t.started_at
          AND other.turn_index <> t.turn_index
    )
    AND NOT EXISTS (
        SELECT 1 FROM turns choice
        WHERE choice.rollout_id = t.rollout_id AND choice.started_at = t.started_at
          AND NOT EXISTS (
              SELECT 1 FROM rewards w
              WHERE w.rollout_id = choice.rollout_id AND w.turn_index = choice.turn_index
          )
    )
),
steps AS (
    SELECT t.rollout_id, t.turn_index, t.parent_turn, t.prefix_tokens, t.prompt_tokens, t.completion_tokens,
           CASE WHEN EXISTS (
                    SELECT 1 FROM turns retry
                    WHERE retry.rollout_id = t.rollout_id AND retry.retry_of = t.turn_index
                ) OR EXISTS (
                    SELECT 1 FROM rewarded_choices c
                    WHERE c.rollout_id = t.rollout_id AND c.turn_index = t.turn_index
                ) THEN 1 ELSE 0 END AS alone
    FROM turns t
    WHERE t.completion_tokens > 0
),
links AS (
    SELECT child.rollout_id, child.parent_turn AS turn_index, MIN(child.turn_index) AS next_turn
    FROM steps child JOIN steps parent
      ON parent.rollout_id = child.rollout_id AND parent.turn_index = child.parent_turn
    WHERE child.prefix_tokens = parent.prompt_tokens + parent.completion_tokens
      AND child.alone = 0 AND parent.alone = 0
    GROUP BY child.rollout_id, child.parent_turn
),
walk (rollout_id, chain, position, turn_index, turn_indices, sampled_tokens) AS (
    SELECT s.rollout_id, s.turn_index, 0, s.turn_index, CAST(s.turn_index AS TEXT), s.completion_tokens
    FROM steps s
    WHERE NOT EXISTS (
        SELECT 1 FROM links l WHERE l.rollout_id = s.rollout_id AND l.next_turn = s.turn_index
    )
    UNION ALL
    SELECT w.rollout_id, w.chain, w.position + 1, l.next_turn,
           w.turn_indices || ',' || CAST(l.next_turn AS TEXT), w.sampled_tokens + s.completion_tokens
    FROM walk w
    JOIN links l ON l.rollout_id = w.rollout_id AND l.turn_index = w.turn_index
    JOIN steps s ON s.rollout_id = l.rollout_id AND s.turn_index = l.next_turn
)
SELECT w.rollout_id, w.chain, w.position, w.turn_index, w.turn_indices, w.sampled_tokens,
       CASE WHEN EXISTS (
           SELECT 1 FROM links l WHERE l.rollout_id = w.rollout_id AND l.turn_index = w.turn_index
       ) THEN 0 ELSE 1 END AS is_last
FROM walk w
"""

VIEWS = {
    "chain_turns": _CHAIN_TURNS,
    "rollout_chains": """
        SELECT rollout_id, chain, position + 1 AS turns, turn_indices, sampled_tokens, turn_index AS last_turn
        FROM chain_turns WHERE is_last = 1
    """,
}


def upgrade() -> None:
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
