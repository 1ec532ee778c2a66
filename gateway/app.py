"""The FastAPI application: wiring of settings, store, backends and routers."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import __version__
from gateway.access_log import AccessLog
from gateway.admin.router import router as admin_router
from gateway.admin.traffic import Traffic
from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.anthropic.router import router as anthropic_router
from gateway.control.router import health_router
from gateway.control.router import router as control_router
from gateway.encoding import JsonResponse
from gateway.errors import install_error_handlers
from gateway.fleet.discovery import BackendFile
from gateway.fleet.pool import BackendPool
from gateway.metrics import Metrics
from gateway.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionTokensRequest,
    CompletionRequest,
    TokenRouteRequest,
)
from gateway.openai.router import router as openai_router
from gateway.openai.router import tokens_router
from gateway.openapi import install_docs, install_openapi
from gateway.responses.protocol import ResponsesRequest
from gateway.responses.router import router as responses_router
from gateway.settings import Settings
from gateway.state import GatewayState
from gateway.store.database import display_url, ensure_schema
from gateway.store.records import Limits
from gateway.store.status import Mode
from gateway.store.store import Store
from gateway.turns.context import TurnContext
from gateway.turns.local_render import LocalRenders
from gateway.turns.recording import Recorder
from gateway.ui.router import router as ui_router
from gateway.ui.tokens import TokenTexts

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    *,
    store: Store | None = None,
    backends: BackendPool | None = None,
) -> FastAPI:
    """The gateway's app. It builds its store and backends from `settings` at start-up unless given them
    (then it leaves them open at shutdown: whoever made them closes them). On PostgreSQL it is one process of
    a gateway that may have many, on this host and others (`gateway.fleet.sync`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_store, own_backends = store is None, backends is None
        if store is None:
            ensure_schema(settings.db)
        app.state.gateway = state = gateway_state(
            settings, store or Store(settings.db), backends or backend_pool(settings)
        )
        if own_backends:
            state.backends.placement.pin_store = state.store.pin
        for url in state.backends.urls:
            capable = await state.backends.probe_scale_out(url)
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
            ", ".join(state.backends.urls),
        )
        warn_if_exposed(settings)
        await state.turns.local_render.build(settings.local_render)
        await state.fleet.start(watch=own_backends)
        # What start-up built (modules, routes, models, pools) lives as long as the app: kept out of the
        # collector's sight, a full collection scans only what calls made since, and holds up the calls in
        # flight for a few milliseconds instead of a hundred.
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            await state.fleet.close()
            if own_backends:
                await state.backends.close()
            if own_store:
                state.store.close()

    app = FastAPI(
        title="rl-gateway",
        version=__version__,
        description="Records every model call's exact tokens between agents and vLLM.",
        lifespan=lifespan,
        default_response_class=JsonResponse,
        docs_url=None,  # served with local assets (install_docs)
        redoc_url=None,
    )
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(tokens_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(control_router)
    app.include_router(health_router)
    app.include_router(admin_router)
    app.include_router(ui_router)
    install_openapi(
        app,
        [
            ChatCompletionRequest,
            ChatCompletionTokensRequest,
            CompletionRequest,
            TokenRouteRequest,
            MessagesRequest,
            CountTokensRequest,
            ResponsesRequest,
        ],
    )
    install_docs(app)
    if settings.access_log:
        app.add_middleware(AccessLog)
    return app


def backend_pool(settings: Settings) -> BackendPool:
    urls = BackendFile(settings.backend_file).read() if settings.backend_file else settings.backend
    return BackendPool(
        urls,
        timeout=settings.backend_timeout,
        connect_timeout=settings.connect_timeout,
        max_connections=settings.max_connections,
        api_key=settings.backend_api_key.get_secret_value() if settings.backend_api_key else None,
    )


def gateway_state(settings: Settings, store: Store, backends: BackendPool) -> GatewayState:
    metrics, traffic = Metrics(), Traffic(settings.pause_timeout)
    metrics.watch(lambda: list(backends.servers.values()))
    recorder = Recorder(store, metrics, settings.policy_version)
    turns = TurnContext(
        recorder=recorder,
        backends=backends,
        traffic=traffic,
        mode=settings.mode,
        limits=Limits(settings.max_turns, settings.max_context_tokens),
        sampling=settings.sampling.model_dump(exclude_none=True) if settings.sampling else None,
        rollout_keys=settings.rollout_keys,
        require_registered=settings.require_registered_rollouts,
        max_body_bytes=settings.max_body_bytes,
        local_render=LocalRenders(),
    )
    return GatewayState(settings, store, backends, metrics, traffic, recorder, turns, TokenTexts(backends))


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
