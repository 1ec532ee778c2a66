"""Every example query of the docs (each `sql` block of README.md and docs/, not marked not-run) runs on a
populated store, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import httpx
import sqlalchemy as sa

from rollout_store.database import make_engine

from support import TIMEOUT
from support.docs import PAGES, ROOT, blocks_of

QUERIES = [block for page in PAGES for block in blocks_of(page, "sql") if block.not_run is None]
SQL_PAGE = ROOT / "docs" / "sql.md"


def test_the_sql_reference_has_example_queries():
    assert len(blocks_of(SQL_PAGE, "sql")) >= 8


def test_every_documented_query_runs_on_a_populated_store(gateway, db_url):
    for group in ("docs-a", "docs-b"):
        for reward in (0.0, 1.0):
            rollout = httpx.post(gateway.url + "/rollouts", json={"group_id": group}, timeout=TIMEOUT).json()[
                "rollout_id"
            ]
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            httpx.post(gateway.agent_url(rollout) + "/chat/completions", json=chat, timeout=TIMEOUT)
            httpx.post(f"{gateway.url}/rollouts/{rollout}/finish", json={"reward": reward}, timeout=TIMEOUT)

    engine = make_engine(db_url)
    failures, rows = [], {}
    for query in QUERIES:
        with (
            engine.connect() as conn
        ):  # one connection each: on PostgreSQL a failed query ends its transaction
            try:
                rows[query] = conn.execute(sa.text(query.body)).all()
            except sa.exc.SQLAlchemyError as exc:
                failures.append(
                    f"{query.page}:{query.line}: {str(getattr(exc, 'orig', None) or exc).splitlines()[0]}"
                )
    with engine.connect() as conn:
        groups = conn.execute(
            sa.text("SELECT reward_mean, reward_std, finished FROM group_stats WHERE group_id = 'docs-a'")
        ).one()
    engine.dispose()
    assert not failures, "\n".join(failures)
    assert rows[blocks_of(SQL_PAGE, "sql")[0]], (
        "the finished groups query (docs/sql.md's first) found no group"
    )
    assert tuple(groups) == (0.5, 0.5, 2)
