"""Stopping a `gateway serve` process as orchestrators do (SIGTERM: Kubernetes, systemd, `docker stop`): it
stops taking connections at once, lets the stream in flight finish with every token, stores its turn and exits
0; with --shutdown-timeout, a stream that outlasts it is cut there and stored as a cancelled turn. The turns
are read back through another replica on the same PostgreSQL store. The engine holds the stream still
(vLLM's own pause, "keep") while the test looks, so it is mid-reply whatever the machine's speed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.turns.recording import CANCELLED
from testbed.launcher import GatewayProcess

from support import TIMEOUT, VLLM_HEADERS, stored_rollout, wait_for

pytestmark = pytest.mark.engine

TOKENS = 2000
"""The reply's length: far more than the engine samples between the stream's first chunk and its pause."""


class Stream:
    """A streamed chat call read in a thread, as an agent reads it: its chunks, whether `[DONE]` came, and
    how the connection broke if it did."""

    def __init__(self, gateway: GatewayProcess, rollout_id: str) -> None:
        self.url = gateway.agent_url(rollout_id) + "/chat/completions"
        self.generating = threading.Event()
        """Set at the first chunk: vLLM sends it with the first sampled token."""
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        self.broken: str | None = None

    def read(self) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say a lot."}],
            "max_tokens": TOKENS,
            "min_tokens": TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", self.url, json=body, timeout=TIMEOUT) as response:
                assert response.status_code == 200, response.read()
                for data in data_lines(response):
                    if data == "[DONE]":
                        self.done = True
                    else:
                        self.chunks.append(json.loads(data))
                        self.generating.set()
        except httpx.TransportError as exc:
            self.broken = type(exc).__name__

    @property
    def content(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c["choices"])

    @property
    def usage(self) -> dict[str, Any] | None:
        return next((c["usage"] for c in self.chunks if c.get("usage")), None)


def data_lines(response: httpx.Response) -> Iterator[str]:
    """A stream's `data:` payloads, split at newlines alone: httpx's iter_lines also ends a line at characters
    a random model writes (U+2028, U+0085), which JSON leaves unescaped inside a chunk's text."""
    pending = b""
    for piece in response.iter_bytes():
        *lines, pending = (pending + piece).split(b"\n")
        yield from (line.removeprefix(b"data: ").decode() for line in lines if line.startswith(b"data: "))


def as_stored(text: str) -> str:
    """Text as the PostgreSQL store keeps it: a NUL the model sampled becomes U+FFFD (the ids are exact)."""
    return text.replace("\x00", "\ufffd")


def engine(vllm: Any, path: str, **kwargs: Any) -> None:
    """One of vLLM's own development endpoints (`/pause`, `/resume`)."""
    httpx.post(vllm.url + path, headers=VLLM_HEADERS, timeout=TIMEOUT, **kwargs).raise_for_status()


def refused(gateway: GatewayProcess) -> bool:
    """Whether a new connection to the gateway is refused (its port closed), or closed or reset unanswered (it
    was accepted into the listening socket's backlog just as the port closed)."""
    try:
        httpx.get(gateway.url + "/healthz", timeout=TIMEOUT)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


def exit_code(gateway: GatewayProcess) -> int:
    """The process's exit status, once it has exited by itself (the launcher's stop() would signal it)."""
    process = gateway._process.process  # type: ignore[union-attr]
    return process.wait(timeout=TIMEOUT)


def stop_mid_stream(
    gateway: GatewayProcess, vllm: Any, rollout_id: str, *, held_until_exit: bool
) -> tuple[Stream, bool, int, float]:
    """SIGTERM `gateway` while a stream is mid-reply, held still by the engine until new connections are
    refused (`held_until_exit`: until the process has exited); then the engine goes on. The stream, whether
    it was still running when the port had closed, the exit status and the seconds from the signal to the
    exit."""
    stream = Stream(gateway, rollout_id)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(stream.read)
        wait_for(stream.generating.is_set, "the stream's first chunk")
        engine(vllm, "/pause", params={"mode": "keep"})  # the stream holds still, mid-reply
        try:
            signalled = time.monotonic()
            os.kill(gateway.pid, signal.SIGTERM)
            wait_for(lambda: refused(gateway), "new connections refused")
            in_flight = not reading.done()
            if held_until_exit:
                code, stopped_after = exit_code(gateway), time.monotonic() - signalled
        finally:
            engine(vllm, "/resume")
        if not held_until_exit:
            code, stopped_after = exit_code(gateway), time.monotonic() - signalled
        reading.result()
    return stream, in_flight, code, stopped_after


def test_sigterm_refuses_new_connections_at_once_finishes_the_stream_in_flight_stores_it_and_exits_0(
    start_gateway, databases, vllm
):
    db_url = databases.new("postgresql")
    stopping, other = (start_gateway(db_url, process=True) for _ in range(2))

    stream, in_flight, code, _ = stop_mid_stream(stopping, vllm, "stopped-gracefully", held_until_exit=False)

    assert in_flight  # the port closed while the stream was still running
    assert (code, stream.done, stream.broken) == (0, True, None)
    assert stream.usage is not None and stream.usage["completion_tokens"] == TOKENS
    finish = [c["choices"][0]["finish_reason"] for c in stream.chunks if c["choices"]][-1]
    (turn,) = stored_rollout(other, "stopped-gracefully")["turns"]
    assert (turn["status"], turn["finish_reason"], finish) == ("ok", "length", "length")
    assert len(turn["completion_token_ids"]) == TOKENS
    assert turn["content"] == as_stored(stream.content)


def test_a_stream_outlasting_the_shutdown_timeout_is_cut_then_and_stored_as_a_cancelled_turn(
    start_gateway, databases, vllm
):
    db_url = databases.new("postgresql")
    stopping = start_gateway(db_url, "--shutdown-timeout", "1", process=True)
    other = start_gateway(db_url, process=True)

    stream, in_flight, code, stopped_after = stop_mid_stream(
        stopping, vllm, "cut-at-shutdown", held_until_exit=True
    )

    assert in_flight
    assert code == 0 and stopped_after >= 1.0  # it gave the stream its second, not the whole reply
    assert (stream.done, stream.broken) == (False, "RemoteProtocolError")  # cut without its end
    (turn,) = stored_rollout(other, "cut-at-shutdown")["turns"]
    assert (turn["status"], turn["error"]) == ("cancelled", CANCELLED)
    assert 0 < len(turn["completion_token_ids"]) < TOKENS
    assert turn["content"] == as_stored(stream.content)  # what the agent had been sent
