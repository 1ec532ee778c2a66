"""Command lines: a database URL the store cannot use is a one-line error naming the URLs it accepts."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine  # each case starts a command line as a process (trainer-client loads torch)

ACCEPTED = "use sqlite:///PATH, postgresql://USER@HOST/DB (or postgresql+psycopg://...)"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgresql+asyncpg://user@host/db", "the store cannot use 'postgresql+asyncpg' URLs"),
        ("sqlite+aiosqlite:///x.db", "the store cannot use 'sqlite+aiosqlite' URLs"),
        ("mysql://user@host/db", "the store cannot use 'mysql' URLs"),
        ("gateway.db", "'gateway.db' is not a database URL"),
    ],
)
def test_an_unusable_database_url_is_a_one_line_error(url, why):
    serve = run("gateway", "serve", "--db", url)
    upgrade = run("gateway", "db", "upgrade", "--db", url)
    stats = run("trainer_client.cli", "stats", "--db", url)

    assert (serve.returncode, upgrade.returncode, stats.returncode) == (2, 2, 2)
    assert serve.stderr.splitlines() == [f"gateway serve: error: --db: {why}; {ACCEPTED}"]
    assert upgrade.stderr.splitlines() == [f"gateway db upgrade: error: --db: {why}; {ACCEPTED}"]
    assert stats.stderr.splitlines() == [f"trainer-client: --db: {why}; {ACCEPTED}"]


def test_several_workers_on_sqlite_is_a_one_line_error(tmp_path):
    serve = run("gateway", "serve", "--workers", "2", "--db", f"sqlite:///{tmp_path}/gateway.db")

    assert serve.returncode == 2
    assert serve.stderr.splitlines() == [
        "gateway serve: error: --workers: several workers need a PostgreSQL store (--db postgresql://...): "
        "SQLite takes one writer"
    ]
