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
from gateway.control.router import health_router
from gateway.control.router import router as control_router
from gateway.encoding import JsonResponse
from gateway.errors import install_error_handlers
from gateway.metrics import Metrics
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai.router import router as openai_router
from gateway.openapi import install_openapi
from gateway.settings import Settings
from gateway.store.status import Mode
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
            api_key=settings.backend_api_key.get_secret_value() if settings.backend_api_key else None,
        )
        app.state.gateway = GatewayState(
            settings, store, backends, Metrics(), settings.policy_version, Traffic(settings.pause_timeout)
        )
        for url in backends.urls:
            capable = await backends.probe_scale_out(url)
            if capable is None:
                log.info("backend %s not reachable yet: exact mode is checked on its first use", url)
            elif not capable and settings.mode == Mode.EXACT:
                log.warning(
                    "backend %s does not serve vLLM's render/generate endpoints (start it with "
                    "--enable-scale-out): its turns run in pass-through mode",
                    url,
                )
        log.info(
            "gateway %s: store %s, backends %s",
            __version__,
            display_url(settings.db),
            ", ".join(settings.backend),
        )
        warn_if_exposed(settings)
        try:
            yield
        finally:
            await backends.close()
            store.close()

    app = FastAPI(
        title="rl-gateway",
        version=__version__,
        description="Records every model call's exact tokens between agents and vLLM.",
        lifespan=lifespan,
        default_response_class=JsonResponse,
    )
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(control_router)
    app.include_router(health_router)
    app.include_router(admin_router)
    install_openapi(app, [ChatCompletionRequest, CompletionRequest])
    return app


def warn_if_exposed(settings: Settings) -> None:
    """Say so when agents could reach what is not theirs."""
    loopback = settings.host in ("127.0.0.1", "localhost", "::1")
    if not loopback and settings.control_token is None:
        log.warning(
            "listening on %s without --control-token: anyone who reaches the gateway, agents included, can "
            "create rollouts, post rewards and finish them (see the README's 'Deploying safely')",
            settings.host,
        )
    if not loopback and not settings.rollout_keys:
        log.warning(
            "listening on %s without --rollout-keys: any caller can make model calls for any rollout",
            settings.host,
        )
    if settings.rollout_keys and settings.control_token is None:
        log.warning(
            "--rollout-keys without --control-token: agents cannot reach each other's rollouts, but can "
            "still post rewards and finish rollouts through the open control API"
        )
