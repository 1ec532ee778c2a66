"""A command's output read by a pipe that closes early (`trainer-client stats | head`) ends the command
quietly, as `cat` ends: no traceback, SIGPIPE's exit status."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from rollout_store.database import ensure_schema
from trainer_client.cli import main as trainer_client


def test_stats_into_a_pipe_its_reader_closed_ends_quietly_with_sigpipes_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    store = f"sqlite:///{tmp_path / 'store.db'}"
    ensure_schema(store)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write meets EPIPE
    with capsys.disabled():
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(os.fdopen(write, "wb")))
        code = trainer_client(["stats", "--db", store])
        sys.stdout.flush()  # what the command left behind goes nowhere, without an error

    assert code == 128 + 13
    assert capsys.readouterr().err == ""
