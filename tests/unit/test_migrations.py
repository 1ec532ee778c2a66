"""The migrations build the schema the code declares (`rollout_store.schema`): a column added to one and not
the other, or declared with another type, is found here rather than by a user's database."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from rollout_store import schema
from rollout_store.database import ensure_schema, make_engine


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_migrations_build_the_tables_the_code_declares(databases: Any, kind: str) -> None:
    url = databases.new(kind)
    ensure_schema(url)
    engine = make_engine(url)

    with engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn), schema.metadata)
    engine.dispose()

    assert differences == []
