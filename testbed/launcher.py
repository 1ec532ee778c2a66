"""Run a gateway as a child process (demo, tests, benchmarks)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from testbed.process import ManagedProcess, start_until_ready


class GatewayProcess:
    def __init__(
        self,
        backends: Sequence[str],
        db_url: str,
        *,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.backends = list(backends)
        self.db_url = db_url
        self.host = host
        self.port = port
        self.extra_args = list(extra_args)
        self.env = env
        self.log_path = log_path
        self._process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self._process is not None and self._process.process is not None, "not started"
        return self._process.process.pid

    def agent_url(self, rollout_id: str) -> str:
        return f"{self.url}/rollouts/{rollout_id}/v1"

    def _make(self, port: int) -> ManagedProcess:
        command = [sys.executable, "-m", "gateway", "serve", "--db", self.db_url, "--host", self.host]
        command += ["--port", str(port), *self.extra_args]
        for backend in self.backends:
            command += ["--backend", backend]
        return ManagedProcess(command, log_path=self.log_path, env=self.env, name="gateway")

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        self._process, self.port = start_until_ready(
            self._make, "/healthz", host=self.host, port=self.port, timeout=timeout
        )
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown code runs."""
        if self._process is not None:
            self._process.kill()

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
