"""A gateway served from a thread of the test process: the app and uvicorn as `gateway serve` runs them, on a
port of its own, without a process to start (a process imports the whole stack anew, most of two seconds
each, and the suite makes hundreds of gateways). Tests of what only a process shows (a kill, several
workers, its log, replicas told apart by their process) start a `GatewayProcess` instead."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
import uvicorn

from gateway.app import create_app
from gateway.cli import build_parser, settings_from
from testbed.process import free_port

from support import TIMEOUT, wait_for


class GatewayThread:
    """What tests use of `GatewayProcess` (`url`, `pid`, `agent_url`, `start`, `stop`), in a thread."""

    def __init__(
        self, backends: Sequence[str], db_url: str, *, log_path: Path, extra_args: Sequence[str] = ()
    ) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.log_path = log_path
        """Nothing is written there: the app logs through the test process's logging, which pytest shows."""
        command = ["serve", "--db", db_url, "--host", self.host, "--port", str(self.port), *extra_args]
        for backend in backends:
            command += ["--backend", backend]
        self.settings = settings_from(build_parser().parse_args(command))
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The process serving it: the test's own."""
        return os.getpid()

    def agent_url(self, rollout_id: str) -> str:
        return f"{self.url}/rollouts/{rollout_id}/v1"

    def start(self) -> GatewayThread:
        config = uvicorn.Config(
            create_app(self.settings),
            host=self.host,
            port=self.port,
            log_level=self.settings.log_level,
            access_log=False,
            timeout_keep_alive=75,  # as `gateway serve`
        )
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, name=f"gateway:{self.port}", daemon=True)
        self._thread.start()
        wait_for(lambda: server.started or not self._thread.is_alive(), "the gateway's start-up")
        if not server.started:
            raise RuntimeError(f"the gateway on port {self.port} did not start: see the test's log")
        assert httpx.get(f"{self.url}/healthz", timeout=TIMEOUT).status_code == 200
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._server = self._thread = None
