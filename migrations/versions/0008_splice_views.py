"""Exact mode's splices per model (a served model has one chat template): how many boundaries spliced onto
the parent's exact ids, were re-rendered (the template moved earlier context) or fell back, and why.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# A boundary: an exact-mode turn whose messages extend an earlier turn's (`splice` other than `render`).
_BOUNDARIES = "FROM turns WHERE splice IS NOT NULL AND splice <> 'render'"
VIEWS = {
    "splice_by_model": f"""
        SELECT model,
               COUNT(*) AS boundaries,
               SUM(CASE WHEN splice = 'exact' THEN 1 ELSE 0 END) AS spliced,
               SUM(CASE WHEN splice LIKE 're-rendered:%' THEN 1 ELSE 0 END) AS re_rendered,
               SUM(CASE WHEN splice LIKE 'fallback:%' THEN 1 ELSE 0 END) AS fallbacks,
               1.0 * SUM(CASE WHEN splice = 'exact' THEN 1 ELSE 0 END) / COUNT(*) AS splice_rate
        {_BOUNDARIES} GROUP BY model
    """,
    "splice_outcomes": f"SELECT model, splice, COUNT(*) AS turns {_BOUNDARIES} GROUP BY model, splice",
}


def upgrade() -> None:
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
