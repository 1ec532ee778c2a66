"""The access log: one info line per HTTP call, written when its response has ended (a stream's last byte,
or the client leaving), so that the latency is the call's whole duration.

    POST /rollouts/r1/v1/chat/completions 200 1532.4 ms rollout=r1

A call the client left before its answer began is logged with status 499, as nginx does; one that failed
before answering, 500.
"""

from __future__ import annotations

import logging
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("gateway.access")

_ROLLOUT = re.compile(r"^/rollouts/([^/]+)")


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 499

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
            path: str = scope["path"]
            rollout = _ROLLOUT.match(path)
            log.info(
                "%s %s %d %.1f ms%s",
                scope["method"],
                path,
                status,
                (time.perf_counter() - started) * 1000,
                f" rollout={rollout.group(1)}" if rollout else "",
            )
