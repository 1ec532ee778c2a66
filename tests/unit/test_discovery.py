"""`--backend-file`: the servers it lists, one URL a line; a URL naming a user is left out, said in the log
without its password (the engine client never sends a URL's user info)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.fleet.discovery import BackendFile


def test_the_file_lists_its_servers_less_comments_and_blank_lines(tmp_path: Path):
    path = tmp_path / "backends"
    path.write_text("# the fleet\nhttp://a:8000\n\n  http://b:8000  # the second\n")

    assert BackendFile(str(path)).read() == ["http://a:8000", "http://b:8000"]


def test_a_url_with_user_info_is_left_out_and_logged_without_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    path = tmp_path / "backends"
    path.write_text("http://a:8000\nhttp://user:S3CRET@b:8000\n")
    caplog.set_level(logging.WARNING, logger="gateway.fleet.discovery")

    assert BackendFile(str(path)).read() == ["http://a:8000"]
    assert [record.getMessage() for record in caplog.records] == [
        f"backend file {path}: http://user:***@b:8000: a backend URL's user info is not sent to the server; "
        "give the gateway's credentials with --backend-api-key (vLLM's --api-key); left out"
    ]
