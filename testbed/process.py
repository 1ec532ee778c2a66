"""Child processes the project starts (vLLM servers, gateways).

Each runs in its own process group (vLLM spawns engine-core workers), is waited for until an HTTP endpoint
answers, and is always stopped with everything it spawned: on `stop()`, at interpreter exit, and (Linux)
when the parent dies (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

ADDRESS_IN_USE = "address already in use"
_live: set[ManagedProcess] = set()


_refusing: list[socket.socket] = []


def refusing_port() -> int:
    """A port of 127.0.0.1 where every connection is refused for the rest of this process: a socket bound
    there and never listening holds it, so no server started later takes it, as a merely free port can be
    taken by the next server started. One for the whole process: what is refused once is refused always."""
    if not _refusing:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        _refusing.append(sock)
    return int(_refusing[0].getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range, so that no outgoing connection takes it before the
    child binds it. Callers still retry on a bind failure: another program may take it."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randint(20000, ephemeral_low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook giving the child SIGTERM when the thread that started it dies (Linux, main thread)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    set_pdeathsig = 1
    return lambda: prctl(set_pdeathsig, signal.SIGTERM, 0, 0, 0)


class ProcessFailed(RuntimeError):
    pass


class ManagedProcess:
    def __init__(
        self, command: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None, name: str
    ) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.env = env
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._log_start = log_file.tell()
            self.process = subprocess.Popen(
                self.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        _live.add(self)

    def wait_ready(
        self, url: str, *, timeout: float, progress: Callable[[float], None] | None = None, every: float = 5.0
    ) -> None:
        """Poll `url` until it answers 200; fail fast with the log's tail if the process exits."""
        assert self.process is not None
        started = last_progress = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise ProcessFailed(
                    f"{self.name} exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            now = time.monotonic()
            if now - started > timeout:
                raise ProcessFailed(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")
            if progress is not None and now - last_progress >= every:
                progress(now - started)
                last_progress = now
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the log written since the latest start."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self._log_start)
                text = log_file.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after `grace` seconds."""
        process = self._forget()
        if process is None:
            return
        self._signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", self.name, grace)
        self._signal_group(process, signal.SIGKILL)
        process.wait()

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would."""
        process = self._forget()
        if process is not None:
            self._signal_group(process, signal.SIGKILL)
            process.wait()

    def _forget(self) -> subprocess.Popen[bytes] | None:
        process, self.process = self.process, None
        _live.discard(self)
        return process

    @staticmethod
    def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)


def start_until_ready(
    make: Callable[[int], ManagedProcess],
    ready_path: str,
    *,
    host: str,
    port: int | None,
    timeout: float,
    progress: Callable[[float], None] | None = None,
) -> tuple[ManagedProcess, int]:
    """Start a server on `port` (or a free one, retried while the port turns out to be taken)."""
    for _attempt in range(1 if port is not None else 5):
        chosen = port if port is not None else free_port(host)
        child = make(chosen)
        child.start()
        try:
            child.wait_ready(f"http://{host}:{chosen}{ready_path}", timeout=timeout, progress=progress)
            return child, chosen
        except BaseException as exc:
            child.kill()
            if (
                port is not None
                or not isinstance(exc, ProcessFailed)
                or ADDRESS_IN_USE not in str(exc).lower()
            ):
                raise
    raise ProcessFailed("could not find a free port")


@atexit.register
def _stop_all() -> None:
    for child in list(_live):
        with contextlib.suppress(Exception):
            child.kill()
