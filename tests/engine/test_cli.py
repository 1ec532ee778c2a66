"""Command lines as processes: a store the gateway cannot reach (with one worker or several) and a port
already taken are one line on standard error, nothing else (no server log, no traceback); trainer-client
without a store leaves no file behind; an export shows its progress bar once. Each mistake's exact line, in
process: tests/unit/test_cli_errors.py."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings

from support import TIMEOUT
from support.fake_engine import URL, Scripted, chat_reply

pytestmark = pytest.mark.engine  # each case starts a command line as a process (trainer-client loads torch)


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd)


UNRESOLVED = (
    "cannot reach the store at postgresql://nohost:5432/x: failed to resolve host 'nohost': Name or service "
    "not known"
)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_store_the_gateway_cannot_reach_is_one_line_before_the_server_starts(workers):
    serve = run("gateway", "serve", "--db", "postgresql://nohost/x", "--port", "0", "--workers", workers)

    assert (serve.returncode, serve.stderr) == (1, f"gateway serve: error: {UNRESOLVED}\n")


def test_a_port_already_taken_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = run("gateway", "serve", "--port", str(port), "--db", f"sqlite:///{tmp_path}/gateway.db")

    assert (serve.returncode, serve.stderr) == (
        1,
        f"gateway serve: error: cannot listen on 127.0.0.1:{port}: address already in use\n",
    )


def test_trainer_client_in_a_directory_without_a_store_says_so_and_creates_none(tmp_path):
    stats = run("trainer_client.cli", "stats", cwd=tmp_path)

    assert (stats.returncode, stats.stderr) == (
        1,
        f"trainer-client stats: error: no store at sqlite:///gateway.db: {tmp_path}/gateway.db does not "
        "exist\n",
    )
    assert list(tmp_path.iterdir()) == []


def store_with_groups(path: Path, groups: int) -> str:
    """A SQLite store with `groups` finished groups of two one-call rollouts, recorded by a gateway in
    process against a scripted engine."""
    url, scripted = f"sqlite:///{path}", Scripted()
    with TestClient(create_app(Settings(db=url, backend=[URL]), engine=scripted)) as gateway:
        engine = scripted.engine
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
