"""The other worker processes of one gateway (`gateway serve --workers N`), reached over unix sockets in a
directory the supervisor made for them: each process listens on `<pid>.sock` there.

One process leads: it holds a lock on `leader.lock` there (taken over when it dies) and alone gives a server
that comes back the weights it missed, so that a server is not reloaded once per process.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.errors import ApiError

log = logging.getLogger(__name__)

_CODE = "worker_unreachable"
_ANSWER_TIMEOUT = 30.0
"""Seconds a process has to answer; calls that wait on purpose (a pause) add their own wait."""


class Peers:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / f"{os.getpid()}.sock"
        """Where this process listens for the others."""
        self._lock = os.open(directory / "leader.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._leading = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def leads(self) -> bool:
        """Whether this process leads, taking the lead if the leader is gone (its lock went with it)."""
        if not self._leading:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self._leading = True
            log.info("worker %d leads (gives returning servers their weights)", os.getpid())
        return True

    def others(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("*.sock") if p != self.socket)

    async def ask(self, path: str, body: object = None, *, wait: float = 0.0) -> list[Any]:
        """Every other process's answer to `path` (POST with `body`, else GET). A process that is gone (its
        socket refuses) is skipped; one that does not answer is an error: the gateway would act half
        changed."""
        answers = await asyncio.gather(*(self._one(peer, path, body, wait) for peer in self.others()))
        return [answer for answer in answers if answer is not None]

    def tell(self, path: str, body: object) -> None:
        """Send without waiting for the answers (what only keeps counts right)."""
        self._keep(self.ask(path, body))

    def _keep(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("telling the other workers failed: %s", task.exception())

    async def _one(self, peer: Path, path: str, body: object, wait: float) -> Any:
        timeout = aiohttp.ClientTimeout(total=_ANSWER_TIMEOUT + wait)
        try:
            async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(peer)), timeout=timeout
            ) as session:
                method = "GET" if body is None else "POST"
                data = None if body is None else orjson.dumps(body)
                async with session.request(method, "http://worker" + path, data=data) as response:
                    payload = await response.read()
                    if response.status != 200:
                        raise ApiError(
                            502, f"worker {peer.stem} answered {path} with {response.status}", _CODE
                        )
                    return orjson.loads(payload)
        except aiohttp.ClientConnectorError as exc:
            if exc.os_error.errno in (errno.ECONNREFUSED, errno.ENOENT):
                peer.unlink(missing_ok=True)  # a process that died without cleaning up
                return None
            raise ApiError(502, f"worker {peer.stem} unreachable: {exc}", _CODE) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ApiError(502, f"worker {peer.stem} did not answer {path}: {exc!r}", _CODE) from exc

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.socket.unlink(missing_ok=True)
        os.close(self._lock)
