"""`--log-format json`: one JSON object a line, with the process, the replica once it has one, and the rollout
of the call a line was logged for; uvicorn's own lines in the same format; the access log's probe filter."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import logs
from gateway.logs import JsonFormatter, QuietProbes
from gateway.settings import LogFormat, Settings

from support import TIMEOUT

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing JSON lines to a buffer; the replica's name is put back after the test."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("gateway.test_log_format")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    before, logs._replica = logs._replica, None  # as in a process that has not joined the store yet
    yield logger, out
    logs._replica = before
    logger.removeHandler(handler)


def written(out: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def test_a_line_is_one_json_object_with_time_level_logger_message_and_pid(lines):
    logger, out = lines
    before = datetime.now(UTC)

    logger.warning("backend %s ejected", "http://a:8000")

    (line,) = written(out)
    time = line.pop("time")
    assert line == {
        "level": "WARNING",
        "logger": "gateway.test_log_format",
        "message": "backend http://a:8000 ejected",
        "pid": os.getpid(),
    }
    assert time.endswith("Z")  # ISO 8601, UTC, to the millisecond
    assert before - timedelta(milliseconds=1) <= datetime.fromisoformat(time) <= datetime.now(UTC)


def test_the_replica_is_on_every_line_once_the_process_has_one(lines):
    logger, out = lines

    logger.info("starting")
    logs.name_replica("host-42-a1b2c3")
    logger.info("joined")

    assert [line.get("replica") for line in written(out)] == [None, "host-42-a1b2c3"]


def test_a_line_logged_on_a_calls_path_names_its_rollout(lines):
    logger, out = lines

    token = logs.rollout.set("r7")
    try:
        logger.info("on the call")
        logger.info("said explicitly", extra={"rollout": "r8"})
    finally:
        logs.rollout.reset(token)
    logger.info("after the call")

    assert [line.get("rollout") for line in written(out)] == ["r7", "r8", None]


def test_an_exception_is_one_exc_field(lines):
    logger, out = lines

    try:
        {}["missing"]
    except KeyError:
        logger.exception("could not commit turn of rollout %s", "r1")

    (line,) = written(out)
    assert line["message"] == "could not commit turn of rollout r1"
    assert line["exc"].startswith("Traceback (most recent call last):\n")
    assert line["exc"].endswith("\nKeyError: 'missing'")


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_probes_and_scrapes_are_dropped_by_the_access_logs_filter(path):
    record = logging.LogRecord("gateway.access", logging.INFO, __file__, 1, "GET %s", (path,), None)
    record.path = path

    assert QuietProbes().filter(record) is False


PROBES_LOGGED = """
import logging
from gateway.logs import configure_logging
from gateway.settings import Settings
configure_logging(Settings(access_log_probes=True))
from gateway.access_log import log  # imported after logging is configured, as the command line does
log.info("GET /healthz 200 0.4 ms", extra={"path": "/healthz"})
log.info("GET /metrics 200 2.0 ms", extra={"path": "/metrics"})
"""


def test_access_log_probes_set_before_the_access_log_is_imported_logs_them():
    assert [line.split(": ", 1)[1] for line in python(PROBES_LOGGED).splitlines()] == [
        "GET /healthz 200 0.4 ms",
        "GET /metrics 200 2.0 ms",
    ]


def test_any_other_path_passes_the_access_logs_filter():
    record = logging.LogRecord("gateway.access", logging.INFO, __file__, 1, "GET /healthz/", (), None)
    record.path = "/healthz/"

    assert QuietProbes().filter(record) is True


def test_the_log_format_is_a_setting_with_two_choices():
    assert [choice.value for choice in LogFormat] == ["text", "json"]
    assert Settings().log_format == LogFormat.TEXT
    assert Settings(log_format="json").log_format == LogFormat.JSON


UVICORN = """
import logging, uvicorn
from gateway.logs import configure_logging
from gateway.settings import Settings
configure_logging(Settings(log_format="json"))
# as uvicorn.run and each worker do, with the gateway's own access log in place of uvicorn's
uvicorn.Config(app=None, log_level="info", access_log=False).configure_logging()
logging.getLogger("uvicorn.error").info("Started server process [%d]", 1)
logging.getLogger("uvicorn.access").info("127.0.0.1:5000 - GET /healthz 200")
logging.getLogger("gateway.app").info("gateway started")
"""


def python(code: str) -> str:
    """What `code` writes to standard error, run in a process of its own (logging's set-up is global)."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    assert done.stdout == ""
    return done.stderr


def test_uvicorns_own_lines_are_json_too_and_its_access_log_stays_off():
    stderr = python(UVICORN)

    assert [(line["logger"], line["message"]) for line in map(orjson.loads, stderr.splitlines())] == [
        ("uvicorn.error", "Started server process [1]"),
        ("gateway.app", "gateway started"),
    ]
