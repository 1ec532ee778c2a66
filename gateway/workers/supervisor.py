"""`gateway serve --workers N`: N processes accept on one port (uvicorn's supervisor starts them and restarts
one that dies) and share one PostgreSQL store, where they hold the fleet alike as replicas on other hosts do
(`gateway.replicas.shared`)."""

from __future__ import annotations

import json
import os
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from gateway.logs import configure_logging
from gateway.settings import Settings

_SPEC = "RL_GATEWAY_WORKER"
"""How the supervisor hands its workers the command line's settings."""


def serve(settings: Settings, flags: dict[str, Any], **server: Any) -> int:
    """Run `settings.workers` processes until stopped; `flags` are the command line's settings (the
    environment's reach the workers by inheritance). 3 when a worker could not start (uvicorn then stops them
    all), else 0."""
    from rollout_store.database import ensure_schema

    ensure_schema(settings.db)  # once, before the workers start
    os.environ[_SPEC] = json.dumps(flags)
    config = uvicorn.Config(
        f"{__name__}:worker_app",
        factory=True,
        workers=settings.workers,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        **server,
    )
    supervisor = Multiprocess(config, sockets=[config.bind_socket()])
    supervisor.run()
    failed = any(process.exitcode == STARTUP_FAILURE for process in supervisor.processes)
    return STARTUP_FAILURE if failed else 0


def worker_app() -> FastAPI:
    """One worker's app (uvicorn calls this in each worker process)."""
    from gateway.app import create_app

    settings = Settings(**json.loads(os.environ[_SPEC]))
    configure_logging(settings)
    return create_app(settings)
