"""The FastAPI application: wiring of settings, store, backends and routers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import __version__
from gateway.admin.router import router as admin_router
from gateway.admin.traffic import Traffic
from gateway.backend import BackendPool
from gateway.control.router import router as control_router
from gateway.errors import install_error_handlers
from gateway.metrics import Metrics
from gateway.openai.router import router as openai_router
from gateway.settings import Settings
from gateway.state import GatewayState
from gateway.store.database import display_url, ensure_schema
from gateway.store.store import Store

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ensure_schema(settings.db)
        store = Store(settings.db)
        backends = BackendPool(
            settings.backend,
            timeout=settings.backend_timeout,
            connect_timeout=settings.connect_timeout,
            max_connections=settings.max_connections,
        )
        app.state.gateway = GatewayState(
            settings, store, backends, Metrics(), settings.policy_version, Traffic(settings.pause_timeout)
        )
        for url in backends.urls:
            capable = await backends.probe_scale_out(url)
            if capable is None:
                log.info("backend %s not reachable yet: exact mode is checked on its first use", url)
            elif not capable and settings.mode == "exact":
                log.warning(
                    "backend %s does not serve vLLM's render/generate endpoints (start it with "
                    "--enable-scale-out): its turns run in pass-through mode",
                    url,
                )
        log.info("gateway %s: store %s, backends %s", __version__, display_url(settings.db), ", ".join(settings.backend))
        try:
            yield
        finally:
            await backends.close()
            store.close()

    app = FastAPI(title="rl-gateway", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(control_router)
    app.include_router(admin_router)
    return app
