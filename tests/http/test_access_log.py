"""The access log: one line per call, written when its answer has ended, with the rollout it was for."""

from __future__ import annotations

import logging
import re

import pytest

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
    await gw.client.get("/healthz")

    assert access_lines(caplog) == [
        ("POST", "/rollouts/r1/v1/chat/completions", "200", "rollout=r1"),
        ("GET", "/healthz", "200", ""),
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
    caplog.set_level(logging.INFO, logger="gateway.access")

    await gw.client.get("/healthz")

    assert access_lines(caplog) == []
