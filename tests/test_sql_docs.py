"""Every example query in docs/sql.md runs on the store, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import sqlalchemy as sa

from gateway.store.database import make_engine

from support import TIMEOUT

DOC = Path(__file__).resolve().parents[1] / "docs" / "sql.md"
QUERIES = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_docs_have_example_queries():
    assert len(QUERIES) >= 8


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
    with engine.connect() as conn:
        results = [conn.execute(sa.text(query)).all() for query in QUERIES]
        groups = conn.execute(
            sa.text("SELECT reward_mean, reward_std, finished FROM group_stats WHERE group_id = 'docs-a'")
        ).one()
    engine.dispose()
    assert all(isinstance(rows, list) for rows in results)
    assert results[0], "the finished groups query found no group"
    assert tuple(groups) == (0.5, 0.5, 2)
