"""The unit tier's store: the gateway's `Store` on a fresh migrated database, SQLite's or PostgreSQL's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.store.store import Store
from rollout_store.database import ensure_schema


@pytest.fixture
def db(databases: Any, db_kind: str) -> str:
    """A fresh migrated database of the test's kind, for what reads it beside the store (a trainer)."""
    url: str = databases.new(db_kind)
    ensure_schema(url)
    return url


@pytest.fixture
def store(db: str) -> Iterator[Store]:
    """The gateway's store on `db`, closed after the test."""
    store = Store(db)
    yield store
    store.close()
