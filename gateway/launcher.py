"""Run a gateway as a child process (demo, tests, benchmarks)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from gateway.process import ManagedProcess, ProcessFailed, free_port


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
    ) -> None:
        self.backends = list(backends)
        self.db_url = db_url
        self.host = host
        self.port = port
        self.extra_args = list(extra_args)
        self.log_path = log_path
        self._process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def agent_url(self, rollout_id: str) -> str:
        return f"{self.url}/rollouts/{rollout_id}/v1"

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        fixed_port = self.port is not None
        for _attempt in range(1 if fixed_port else 5):
            if not fixed_port:
                self.port = free_port(self.host)
            command = [sys.executable, "-m", "gateway", "serve", "--db", self.db_url, "--host", self.host]
            command += ["--port", str(self.port), *self.extra_args]
            for backend in self.backends:
                command += ["--backend", backend]
            self._process = ManagedProcess(command, log_path=self.log_path, name="gateway")
            self._process.start()
            try:
                self._process.wait_ready(self.url + "/healthz", timeout=timeout)
                return self
            except ProcessFailed as exc:
                self._process.stop()
                if fixed_port or "address already in use" not in str(exc):
                    raise
        raise ProcessFailed(f"gateway could not bind a free port:\n{self.log_path}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
