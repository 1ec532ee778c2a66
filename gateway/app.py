"""The FastAPI application: wiring of settings, store, backends and routers."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from gateway import __version__
from gateway.access_log import AccessLog, CallContext
from gateway.admin.context import AdminContext
from gateway.admin.router import router as admin_router
from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.anthropic.router import router as anthropic_router
from gateway.auth import Tokens
from gateway.control.context import ControlContext, Lifecycle
from gateway.control.router import health_router
from gateway.control.router import router as control_router
from gateway.encoding import JsonResponse
from gateway.errors import install_error_handlers
from gateway.fleet.collector import KvEventsCollector, LeaderCollector, LoadCollector
from gateway.fleet.discovery import BackendFile
from gateway.fleet.engine import Engine, EngineClient, turn_client
from gateway.fleet.fleet import Fleet
from gateway.fleet.http1 import Http1Client
from gateway.fleet.placement import PinStore
from gateway.metrics import Metrics
from gateway.openai.protocol import ChatCompletionTokensRequest, CompletionRequest, TokenRouteRequest
from gateway.openai.router import router as openai_router
from gateway.openai.router import tokens_router
from gateway.openapi import install_docs, install_openapi
from gateway.replicas import adapters, publish
from gateway.replicas.expiry import expiring
from gateway.replicas.replica import LocalReplica, Replica
from gateway.replicas.shared import SharedReplica
from gateway.responses.protocol import ResponsesRequest
from gateway.responses.router import router as responses_router
from gateway.settings import PlacementPolicy, Settings
from gateway.store.processes import ProcessIdentity
from gateway.store.records import Limits
from gateway.store.store import Store
from gateway.telemetry import TurnSpans
from gateway.turns.context import TurnContext
from gateway.turns.local_render import LocalRenders
from gateway.turns.recording import Recorder
from gateway.turns.requests import ChatCompletionRequest
from gateway.turns.traffic import Traffic
from gateway.ui.context import ViewerContext
from gateway.ui.router import router as ui_router
from gateway.ui.token_texts import TokenTexts
from rollout_store.database import display_url, ensure_schema, is_sqlite
from rollout_store.status import Mode

log = logging.getLogger(__name__)


Scripted = Callable[[Fleet], Engine]
"""A stand-in for the engine client on the app's fleet (the in-process tests' scripted engine)."""


def create_app(settings: Settings, *, store: Store | None = None, engine: Scripted | None = None) -> FastAPI:
    """The gateway's app. It builds its store from `settings` at start-up unless given one (then it leaves it
    open at shutdown: whoever made it closes it), and its fleet and engine client, or the `engine` given on
    its fleet (then no health checks run). On PostgreSQL it is one process of a gateway that may have many,
    on this host and others (`gateway.replicas.shared`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        parts = await _start(app, settings, store, engine)
        thresholds = _freeze_what_start_up_built()
        watch = asyncio.create_task(parts.metrics.watch_loop())
        try:
            yield
        finally:
            await _shut_down(parts, settings, watch, thresholds, own_store=store is None)

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
    _install_routes(app)
    app.add_middleware(
        AccessLog if settings.access_log else CallContext
    )  # CallContext: a call's rollout and trace
    return app


def _install_routes(app: FastAPI) -> None:
    """The APIs' routes in the order the OpenAPI document lists them, with the request bodies it describes
    in full (the routes read theirs themselves)."""
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


async def _start(app: FastAPI, settings: Settings, store: Store | None, scripted: Scripted | None) -> Started:
    """Everything the app serves with, ready before its first call: a backend that does not answer, or
    answers without exact mode's endpoints, is said at once rather than at the first call it fails."""
    if store is None:
        ensure_schema(settings.db)
    parts = wire(app, settings, store or Store(settings.db), scripted)
    await _probe_backends(parts, settings.mode)
    log.info(
        "gateway %s: store %s, backends %s",
        __version__,
        display_url(settings.db),
        ", ".join(parts.fleet.urls),
    )
    warn_if_exposed(settings)
    await parts.local_render.build(settings.local_render)
    _run_in_background(parts, settings, health_checks=scripted is None)
    await parts.replica.start()
    await parts.store.publish_version(None, parts.replica.held.policy_version)  # the run's first, if it is
    return parts


async def _probe_backends(parts: Started, mode: Mode) -> None:
    """A backend down or without exact mode's endpoints does not stop the start: the operator is told why
    its calls go elsewhere or run in pass-through mode."""
    for url in parts.fleet.urls:
        capable = await parts.engine.probe_scale_out(url)
        if capable is None:
            log.warning(
                "backend %s does not answer: the gateway starts without it; calls go to the other "
                "backends, or are refused while none answers",
                url,
            )
        elif not capable and mode == Mode.EXACT:
            log.warning(
                "backend %s does not serve vLLM's render/generate endpoints (start it with "
                "--enable-scale-out): its turns run in pass-through mode",
                url,
            )


def _run_in_background(parts: Started, settings: Settings, *, health_checks: bool) -> None:
    """The replica's own tasks, closed with it: the servers' health checks (not on a scripted engine,
    which has no servers to check) and the idle rollouts' expiry."""
    listing = BackendFile(settings.backend_file) if settings.backend_file else None
    if health_checks:
        parts.replica.run_in_background(
            publish.checked(parts.replica, parts.fleet, parts.engine, listing, settings.health_interval)
        )
    if settings.rollout_idle_timeout:
        parts.replica.run_in_background(
            expiring(parts.replica, parts.store, parts.fleet, settings.rollout_idle_timeout)
        )


def _freeze_what_start_up_built() -> tuple[int, int, int]:
    """What start-up built (modules, routes, models, pools) lives as long as the app: kept out of the
    collector's sight, a full collection scans only what calls made since, and holds up the calls in flight
    for a few milliseconds instead of a hundred. Every call leaves hundreds of containers alive for its
    length (its messages, its chunks): at the default threshold (700) the youngest generation was collected
    200 times a second under 64 streams, and collections took 8% of the event loop's time; at 10,000, 3%, in
    pauses of about 5 ms. Returns the thresholds to restore at shutdown."""
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(10_000, 10, 10)
    return thresholds


async def _shut_down(
    parts: Started,
    settings: Settings,
    watch: asyncio.Task[None],
    thresholds: tuple[int, int, int],
    *,
    own_store: bool,
) -> None:
    """The calls in flight end first, then what they used: the replica, the engine client, the fleet, the
    store (when the app made it) and the traces' exporter."""
    parts.lifecycle.stopping = True
    await drain(parts.traffic, settings.backend_timeout)
    watch.cancel()
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    await parts.replica.close()
    await parts.engine.close()
    await parts.fleet.close()
    if own_store:
        parts.store.close()
    if parts.spans is not None:  # the last turns' spans: sending them can take the exporter's timeout
        await asyncio.to_thread(parts.spans.shutdown)


@dataclass(frozen=True)
class Started:
    """What the app's start and shutdown handle; the routers hold only their own contexts."""

    store: Store
    fleet: Fleet
    engine: Engine
    replica: Replica
    local_render: LocalRenders
    metrics: Metrics
    traffic: Traffic
    lifecycle: Lifecycle
    spans: TurnSpans | None = None


def wire(app: FastAPI, settings: Settings, store: Store, scripted: Scripted | None = None) -> Started:
    """Build the gateway's parts, each with what it depends on, and hand each API the ones it uses
    (`app.state`, read by the routers' dependencies)."""
    metrics, traffic = Metrics(lambda: store.commits), Traffic(settings.pause_timeout)
    api_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
    calls = turn_client(
        timeout=settings.backend_timeout,
        connect_timeout=settings.connect_timeout,
        max_connections=settings.max_connections,
        api_key=api_key,
    )
    fleet = _fleet(
        settings,
        calls,
        metrics,
        pins=store if scripted is None else None,  # a scripted engine's pins stay in this process
        adapter_freed=lambda: replica.run_in_background(adapters.release(replica, fleet, engine)),
    )
    spans = TurnSpans(settings.otlp_endpoint) if settings.otlp_endpoint else None
    recorder = Recorder(store, metrics, settings.policy_version, spans, fleet.prefixes)
    replica = _replica(settings, store, fleet, traffic, recorder, metrics)
    engine = (
        scripted(fleet)
        if scripted is not None
        else _engine_client(settings, fleet, calls, api_key, metrics, replica)
    )
    metrics.queued.set_function(lambda: engine.queued)
    parts = Started(store, fleet, engine, replica, LocalRenders(), metrics, traffic, Lifecycle(), spans)
    _install_contexts(app, settings, parts, recorder)
    return parts


def _fleet(
    settings: Settings,
    calls: Http1Client,
    metrics: Metrics,
    *,
    pins: PinStore | None,
    adapter_freed: Callable[[], None],
) -> Fleet:
    """The fleet of vLLM servers, its load, leaders and KV-cache events exported with the metrics."""
    fleet = Fleet(
        BackendFile(settings.backend_file).read() if settings.backend_file else settings.backend,
        left=calls.forget,
        pins=pins,
        by_group=settings.placement == PlacementPolicy.GROUP,
        placed=lambda reason: metrics.placements.labels(reason=reason).inc(),
        kv_events=settings.kv_events,
        lora_bases=settings.lora_bases,
        lora_keep=settings.lora_keep,
        adapter_freed=adapter_freed,
        first_version=settings.policy_version,
    )
    metrics.registry.register(LoadCollector(lambda: list(fleet.servers.values())))
    metrics.registry.register(LeaderCollector(fleet.leaders))
    metrics.registry.register(KvEventsCollector(lambda: fleet.events))
    return fleet


def _replica(
    settings: Settings, store: Store, fleet: Fleet, traffic: Traffic, recorder: Recorder, metrics: Metrics
) -> Replica:
    """On SQLite the one process of its gateway; on PostgreSQL one of many, which share their state through
    the store."""
    identity = ProcessIdentity.of_this_process(settings.port)
    if is_sqlite(settings.db):
        return LocalReplica(
            identity, store, fleet, traffic, recorder, metrics, timeout=settings.process_timeout
        )
    return SharedReplica(
        identity,
        store,
        fleet,
        traffic,
        recorder,
        metrics,
        db=settings.db,
        interval=settings.heartbeat_interval,
        timeout=settings.process_timeout,
        share_samples=settings.workers > 1,
    )


def _engine_client(
    settings: Settings,
    fleet: Fleet,
    calls: Http1Client,
    api_key: str | None,
    metrics: Metrics,
    replica: Replica,
) -> EngineClient:
    """The engine client on real servers: what it sees of them (a server ejected, one back) reaches the
    other processes through the replica."""
    return EngineClient(
        fleet,
        calls,
        timeout=settings.backend_timeout,
        connect_timeout=settings.connect_timeout,
        max_queued=settings.max_queued,
        api_key=api_key,
        waited=metrics.stage["queue"].observe,
        ejected=lambda server: replica.run_in_background(publish.ejected(replica, server)),
        revived=lambda seen: replica.run_in_background(publish.publish_health(replica, seen)),
    )


def _install_contexts(app: FastAPI, settings: Settings, parts: Started, recorder: Recorder) -> None:
    """Each API's context on `app.state`, where its routers' dependencies read it: a router reaches only
    the parts its context holds."""
    app.state.tokens = Tokens(settings.control_token, settings.admin_token)
    app.state.turns = TurnContext(
        recorder=recorder,
        engine=parts.engine,
        traffic=parts.traffic,
        mode=settings.mode,
        limits=Limits(settings.max_turns, settings.max_context_tokens),
        sampling=settings.sampling.model_dump(exclude_none=True) if settings.sampling else None,
        rollout_keys=settings.rollout_keys,
        require_registered=settings.require_registered_rollouts,
        max_body_bytes=settings.max_body_bytes,
        local_render=parts.local_render,
        adapters=parts.fleet.adapters,
        leader_first=settings.leader_first,
    )
    app.state.control = ControlContext(
        parts.store,
        parts.fleet,
        recorder,
        parts.replica,
        settings.mode,
        settings.rollout_keys,
        settings.public_url,
        parts.lifecycle,
    )
    app.state.admin = AdminContext(
        parts.replica, parts.fleet, parts.engine, recorder, parts.store, settings.pause_clear_cache
    )
    app.state.viewer = ViewerContext(parts.store, TokenTexts(parts.engine))


_DRAIN_POLL = 0.05
"""Seconds between looks at the calls still in flight while shutting down."""


async def drain(traffic: Traffic, timeout: float) -> None:
    """Let the calls in flight finish (up to a backend reply's timeout) before the store and backends close,
    while /readyz says the process is shutting down. Under uvicorn they have finished already (it waits for
    its connections before the app's shutdown); an app run otherwise (in process) has its own."""
    deadline = asyncio.get_running_loop().time() + timeout
    while traffic.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(_DRAIN_POLL)
    if traffic.in_flight:
        log.warning("shutting down with %d calls still in flight after %.0f s", traffic.in_flight, timeout)


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
