"""The examples users copy (examples/), loaded as their command lines load them, and the environment example
played on the tests' gateway: what tests/engine/test_examples.py, test_trl.py and test_verl.py share."""

from __future__ import annotations

import importlib
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa

from rollout_store.database import make_engine

from support import stored_rollout

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TASKS = ["Say something.", "Name a colour."]


def example(name: str) -> ModuleType:
    """examples/<name>.py as a module; the examples import each other by file name, as when run."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def query(db_url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(sa.text(sql)).all()]
    finally:
        engine.dispose()


def play_environment(gateway_url: str, run: str, *options: str) -> tuple[int, str]:
    """examples/environment.py with its defaults (groups of 4, 2 rollouts at once) on TASKS, replies of 8
    tokens sampled with the same seeds every run, and `options`: its exit code and what it printed."""
    printed = io.StringIO()
    with redirect_stdout(printed):
        code = example("environment").main(
            [
                *("--gateway", gateway_url, "--model", "tiny", "--max-tokens", "8", "--sampling-seed", "1"),
                *("--run", run, *options),
                *(arg for task in TASKS for arg in ("--task", task)),
            ]
        )
    return code, printed.getvalue()


def rollouts_of(gateway: Any, db_url: str, group_ids: list[str]) -> list[dict[str, Any]]:
    """The groups' rollouts as GET /rollouts/{id} shows them, found through the store."""
    names = ", ".join(f"'{group_id}'" for group_id in group_ids)
    found = query(db_url, f"SELECT rollout_id FROM rollouts WHERE group_id IN ({names}) ORDER BY created_at")
    return [stored_rollout(gateway, rollout_id) for (rollout_id,) in found]
