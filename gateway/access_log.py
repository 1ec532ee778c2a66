"""The access log: one info line per HTTP call, written when its response has ended (a stream's last byte,
or the client leaving), so that the latency is the call's whole duration.

    POST /rollouts/r1/v1/chat/completions 200 1532.4 ms rollout=r1

A call the client left before its answer began is logged with status 499, as nginx does; one that failed
before answering, 500. The health probes and the metrics scrapes are left out unless `--access-log-probes`
(`gateway.logs.QuietProbes`).

The middleware also says, for the call's whole path, which rollout it is for (`gateway.logs.rollout`: on
every log line of the call) and the trace context its harness sent (`gateway.telemetry.incoming`: the turn's
span continues that trace); `CallContext` says it without the access log.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import logs, telemetry

log = logging.getLogger("gateway.access")
log.addFilter(logs.QuietProbes())

_ROLLOUT = re.compile(r"^/rollouts/([^/]+)")


@contextmanager
def call_context(scope: Scope) -> Iterator[str | None]:
    """The call's rollout and its harness's trace context, for the call's whole path (its tasks inherit
    them); yields the rollout. Two context variables per call, nothing per token."""
    match = _ROLLOUT.match(scope["path"])
    rollout = match.group(1) if match else None
    call = logs.rollout.set(rollout)
    trace = telemetry.incoming.set(telemetry.trace_headers(scope["headers"]) if rollout else None)
    try:
        yield rollout
    finally:
        telemetry.incoming.reset(trace)
        logs.rollout.reset(call)


class CallContext:
    """`call_context` for every call, where no access log is installed (`--no-access-log`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with call_context(scope):
            await self.app(scope, receive, send)


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with call_context(scope) as rollout:
            await self._logged(scope, receive, send, rollout)

    async def _logged(self, scope: Scope, receive: Receive, send: Send, rollout: str | None) -> None:
        started = time.perf_counter()
        status = 499
        path: str = scope["path"]

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if status == 499:  # it failed before answering: the server's error handler answers 500
                status = 500
            raise
        finally:
            duration = round((time.perf_counter() - started) * 1000, 1)
            method: str = scope["method"]
            log.info(
                "%s %s %d %.1f ms%s",
                method,
                path,
                status,
                duration,
                f" rollout={rollout}" if rollout else "",
                extra={
                    "rollout": rollout,
                    "method": method,
                    "path": path,
                    "status": status,
                    "duration_ms": duration,
                },
            )
