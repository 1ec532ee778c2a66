"""The access log: one line per call, written when its answer has ended, with the rollout it was for; the
health probes and metrics scrapes only with --access-log-probes."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import orjson
import pytest

from gateway.logs import JsonFormatter, configure_access_log
from gateway.settings import Settings

from support.fake_engine import chat_reply

pytestmark = pytest.mark.anyio

LINE = re.compile(r"^(\S+) (\S+) (\d{3}) (\d+\.\d) ms( rollout=\S+)?$")


def access_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, ...]]:
    """The access log's lines as (method, path, status, rollout), each checked for its latency."""
    lines = []
    for record in caplog.records:
        if record.name == "gateway.access":
            match = LINE.match(record.getMessage())
            assert match, record.getMessage()
            assert record.levelno == logging.INFO
            lines.append((match[1], match[2], match[3], (match[5] or "").strip()))
    return lines


async def test_an_agent_call_is_logged_with_its_status_and_rollout(gw, caplog):
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))
    caplog.set_level(logging.INFO, logger="gateway.access")

    await gw.chat("r1", max_tokens=2)
    await gw.client.get("/openapi.json")

    assert access_lines(caplog) == [
        ("POST", "/rollouts/r1/v1/chat/completions", "200", "rollout=r1"),
        ("GET", "/openapi.json", "200", ""),
    ]


async def test_a_refused_call_is_logged_with_its_error_status(gw, caplog):
    caplog.set_level(logging.INFO, logger="gateway.access")

    await gw.client.post("/rollouts/r2/v1/chat/completions", content=b"{not json")
    await gw.client.get("/nowhere")

    assert access_lines(caplog) == [
        ("POST", "/rollouts/r2/v1/chat/completions", "400", "rollout=r2"),
        ("GET", "/nowhere", "404", ""),
    ]


async def test_no_access_log_writes_no_line(start, caplog):
    gw = await start(access_log=False)
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))
    caplog.set_level(logging.INFO, logger="gateway.access")

    await gw.chat("r3", max_tokens=2)

    assert access_lines(caplog) == []


@pytest.fixture
def probes_logged() -> Iterator[None]:
    """`--access-log-probes`, as the command line configures it, for one test."""
    configure_access_log(Settings(access_log_probes=True))
    yield
    configure_access_log(Settings())


async def probe(gw) -> None:
    """The probes' calls (the scripted engine serves no /metrics: tests/unit/test_logs.py has its)."""
    for path in ("/healthz", "/readyz"):
        await gw.client.get(path)


async def test_probes_are_left_out_by_default(gw, caplog):
    caplog.set_level(logging.INFO, logger="gateway.access")

    await probe(gw)
    await gw.client.get("/healthz/")

    assert access_lines(caplog) == [("GET", "/healthz/", "307", "")]


async def test_access_log_probes_logs_the_probes(gw, caplog, probes_logged):
    caplog.set_level(logging.INFO, logger="gateway.access")
    readyz = (await gw.client.get("/readyz")).status_code

    await probe(gw)

    assert access_lines(caplog) == [
        ("GET", "/readyz", str(readyz), ""),
        ("GET", "/healthz", "200", ""),
        ("GET", "/readyz", str(readyz), ""),
    ]


async def test_a_json_access_line_has_the_call_as_fields(gw, caplog):
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [5, 0], "x"))
    caplog.set_level(logging.INFO, logger="gateway.access")

    await gw.chat("r4", max_tokens=2)

    (record,) = [r for r in caplog.records if r.name == "gateway.access"]
    line = orjson.loads(JsonFormatter().format(record))
    assert line["duration_ms"] > 0
    assert {k: v for k, v in line.items() if k not in ("time", "duration_ms")} == {
        "level": "INFO",
        "logger": "gateway.access",
        "message": f"POST /rollouts/r4/v1/chat/completions 200 {line['duration_ms']:.1f} ms rollout=r4",
        "pid": record.process,
        "replica": gw.app.state.admin.replica.process_id,
        "rollout": "r4",
        "method": "POST",
        "path": "/rollouts/r4/v1/chat/completions",
        "status": 200,
    }
