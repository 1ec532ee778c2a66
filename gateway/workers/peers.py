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
        self.generation = 0
        """The newest fleet this process holds (`gateway.workers.fleet.Fleet.generation`)."""
        self._lock = os.open(directory / "leader.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._leading = False
        self._sessions: dict[Path, aiohttp.ClientSession] = {}
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

    async def ask(
        self, path: str, body: object = None, *, wait: float = 0.0, strict: bool = True
    ) -> list[Any]:
        """Every other process's answer to `path` (POST with `body`, else GET). A process that is gone (its
        socket refuses) is skipped. One that does not answer is an error when `strict` (the gateway would act
        half changed), else left out."""
        calls = [self._one(peer, path, body, wait) for peer in self.others()]
        answers = await asyncio.gather(*calls, return_exceptions=not strict)
        for answer in answers:
            if isinstance(answer, BaseException):
                log.warning("a worker did not answer %s: %s", path, answer)
        return [answer for answer in answers if answer is not None and not isinstance(answer, BaseException)]

    def tell(self, path: str, body: object) -> None:
        """Send without waiting for the answers (what only keeps counts right)."""
        self.keep(self.ask(path, body, strict=False))

    def keep(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` in the background, held until done (closing this process cancels it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background work for the other workers failed: %s", task.exception())

    def _session(self, peer: Path) -> aiohttp.ClientSession:
        session = self._sessions.get(peer)
        if session is None:
            connector = aiohttp.UnixConnector(path=str(peer), limit=8)
            session = self._sessions[peer] = aiohttp.ClientSession(connector=connector)
        return session

    async def _one(self, peer: Path, path: str, body: object, wait: float) -> Any:
        timeout = aiohttp.ClientTimeout(total=_ANSWER_TIMEOUT + wait)
        method = "GET" if body is None else "POST"
        data = None if body is None else orjson.dumps(body)
        try:
            async with self._session(peer).request(
                method, "http://worker" + path, data=data, timeout=timeout
            ) as response:
                payload = await response.read()
                if response.status != 200:
                    raise ApiError(502, f"worker {peer.stem} answered {path} with {response.status}", _CODE)
                return orjson.loads(payload)
        except aiohttp.ClientConnectorError as exc:
            if exc.os_error.errno in (errno.ECONNREFUSED, errno.ENOENT):
                await self._forget(peer)  # a process that died without cleaning up
                return None
            raise ApiError(502, f"worker {peer.stem} unreachable: {exc}", _CODE) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ApiError(502, f"worker {peer.stem} did not answer {path}: {exc!r}", _CODE) from exc

    async def _forget(self, peer: Path) -> None:
        peer.unlink(missing_ok=True)
        session = self._sessions.pop(peer, None)
        if session is not None:
            await session.close()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in self._sessions.values():
            await session.close()
        self.socket.unlink(missing_ok=True)
        os.close(self._lock)
