"""Child processes the project starts (vLLM servers, gateways): started in their own process group, waited
for until an HTTP endpoint answers, and always stopped with everything they spawned."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Callers retry on a bind failure, as another process may take it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                self.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )

    def wait_ready(
        self,
        url: str,
        *,
        timeout: float,
        progress: Callable[[float], None] | None = None,
        progress_every: float = 5.0,
    ) -> None:
        """Poll `url` until it answers 200; fail fast with the log's tail if the process exits."""
        assert self.process is not None
        started = time.monotonic()
        last_progress = started
        while True:
            if self.process.poll() is not None:
                raise ProcessFailed(
                    f"{self.name} exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - started > timeout:
                raise ProcessFailed(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")
            if progress is not None and now - last_progress >= progress_every:
                progress(now - started)
                last_progress = now
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after `grace` seconds."""
        process, self.process = self.process, None
        if process is None:
            return
        self._signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s: killing it", self.name, grace)
        self._signal_group(process, signal.SIGKILL)
        process.wait()

    def kill(self) -> None:
        """SIGKILL at once, as a crash would."""
        process, self.process = self.process, None
        if process is not None:
            self._signal_group(process, signal.SIGKILL)
            process.wait()

    @staticmethod
    def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
