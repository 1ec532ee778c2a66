"""Command lines: a database URL the store cannot use is a one-line error naming the URLs it accepts; an
export shows its progress bar once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fake_engine import URL, FakeEngine, chat_reply
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings

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


def test_heartbeats_on_sqlite_are_a_one_line_error(tmp_path):
    serve = run("gateway", "serve", "--process-timeout", "3", "--db", f"sqlite:///{tmp_path}/gateway.db")

    assert serve.returncode == 2
    assert serve.stderr.splitlines() == [
        "gateway serve: error: --process-timeout: for gateway processes sharing a PostgreSQL store; a SQLite "
        "store has one process"
    ]


def store_with_groups(path: Path, groups: int) -> str:
    """A SQLite store with `groups` finished groups of two one-call rollouts, recorded by a gateway in
    process against a scripted engine."""
    url, engine = f"sqlite:///{path}", FakeEngine()
    with TestClient(create_app(Settings(db=url, backend=[URL]), backends=engine)) as gateway:
        for group in range(groups):
            for reward in (0.0, 1.0):
                rollout_id = f"g{group}-{reward}"
                gateway.post("/rollouts", json={"rollout_id": rollout_id, "group_id": f"g{group}"})
                engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8], "ok"))
                body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
                gateway.post(f"/rollouts/{rollout_id}/v1/chat/completions", json=body).raise_for_status()
                gateway.post(f"/rollouts/{rollout_id}/finish", json={"reward": reward}).raise_for_status()
    return url


def test_an_export_draws_its_progress_bar_once_on_stderr(tmp_path):
    db = store_with_groups(tmp_path / "gateway.db", 3)
    output = tmp_path / "samples.jsonl"

    export = run("trainer_client.cli", "export", "--db", db, "-o", str(output))

    assert export.returncode == 0, export.stderr
    bar = r"exporting: 100%\|█{10}\| 3/3 \[\d\d:\d\d<00:00, [^\]\n\r]+group/s\]"
    assert re.fullmatch(f"{bar}\nwrote 6 samples to {re.escape(str(output))}\n", export.stderr), export.stderr
    assert len(output.read_text().splitlines()) == 6
