"""Weight-sync coordination and the fleet's servers: every gateway process and every vLLM backend pause, take
a new version, resume. Each change is one step of the run state (`gateway.replicas.replica`), which every
process of the gateway holds before the admin call returns."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from gateway.admin.context import AdminContext
from gateway.admin.protocol import AdapterView, AdminState, BackendView, WorkerView
from gateway.errors import ApiError
from gateway.fleet.kv_events import KvEvents
from gateway.fleet.prefixes import PrefixIndex
from gateway.fleet.servers import Server
from gateway.fleet.weight_versions import RELOAD, RELOAD_BODY, WEIGHT_VERSION
from gateway.replicas import adapters, publish
from gateway.store.processes import ProcessRow
from gateway.store.run_state import AdapterVersion, PauseMode, RunState, ServerEntry

log = logging.getLogger(__name__)

ABORT_QUIET = 2.0
"""An abort-mode pause returns once no call has ended for this many seconds: the aborted ones have been
recorded (under load their ends take a while to come through), and those left are queued in vLLM until the
resume."""
ABORT_FIRST = 10.0
"""How long an abort-mode pause waits for the first aborted call to end: with 200 streams on two cores the
first ends came through more than 2 s after vLLM's pause."""


async def admin_state(admin: AdminContext) -> AdminState:
    replica, timeout = admin.replica, admin.replica.timeout
    rows = await replica.processes()
    alive = [row for row in rows if row.heartbeat_age < timeout]
    held = replica.held
    return AdminState(
        epoch=held.epoch,
        paused=held.paused,
        pause_mode=held.pause_mode if held.paused else None,
        paused_by=held.paused_by if held.paused else None,
        cache_kept=held.cache_kept,
        in_flight=sum(row.in_flight for row in alive),
        waiting=sum(row.waiting for row in alive),
        policy_version=admin.recorder.policy_version,
        adapters=_adapter_views(admin, alive),
        backends=[
            _backend_view(server, alive, admin.fleet.prefixes, admin.fleet.events)
            for server in admin.fleet.servers.values()
        ],
        workers=[_worker_view(row, timeout) for row in rows],
    )


def _adapter_views(admin: AdminContext, alive: list[ProcessRow]) -> list[AdapterView]:
    adapters = admin.fleet.adapters
    calls: Counter[str] = Counter()
    for row in alive:
        calls.update(row.adapter_holds)
    return [
        AdapterView(
            policy=v.policy,
            version=v.version,
            name=v.name,
            path=v.path,
            live=adapters.live(v.policy) == v,
            retired=v.retired,
            calls=calls[v.name],
            backends=[s.url for s in admin.fleet.servers.values() if v.name in s.models],
        )
        for v in adapters.versions
    ]


def _backend_view(
    server: Server, alive: list[ProcessRow], prefixes: PrefixIndex, events: KvEvents | None
) -> BackendView:
    """The server as this process sees it, with every live process's load added up (rollouts pinned are the
    store's count, the same in each)."""
    view = server.view()
    blocks = prefixes.servers.get(server.url)
    view["cached_blocks"] = blocks.size if blocks is not None else 0
    view["cached_known_from"] = "events" if blocks is not None and blocks.from_events else "calls"
    reader = events.readers.get(server.url) if events is not None else None
    view["kv_events"] = reader.state if reader is not None else None
    view["kv_events_error"] = reader.error if reader is not None else None
    loads = [row.loads[server.url] for row in alive if server.url in row.loads]
    for field in ("in_flight", "requests", "errors"):
        view[field] = sum(getattr(load, field) for load in loads)
    return BackendView.model_validate(view)


def _worker_view(row: ProcessRow, timeout: float) -> WorkerView:
    return WorkerView(
        process_id=row.process_id,
        host=row.host,
        pid=row.pid,
        port=row.port,
        alive=row.heartbeat_age < timeout,
        heartbeat_age=round(row.heartbeat_age, 3),
        applied_epoch=row.applied_epoch,
        in_flight=row.in_flight,
        waiting=row.waiting,
        requests=sum(load.requests for load in row.loads.values()),
    )


async def pause(admin: AdminContext, mode: PauseMode, timeout: float, clear_cache: bool) -> AdminState:
    """Hold new agent calls on every process, then deal with those in flight as vLLM's own /pause does,
    dropping the servers' caches or keeping them."""
    by = admin.replica.process_id

    def paused(state: RunState) -> None:
        state.paused, state.pause_mode, state.paused_by = True, mode, by
        state.cache_kept = not clear_cache

    await admin.replica.change(paused)
    if mode == "wait":
        try:
            drained = await admin.replica.until(_idle, timeout)
        except Exception:  # the store could not be read: the pause is undone
            await admin.replica.change(_opened)
            raise
        if not drained:
            await admin.replica.change(_opened)
            raise ApiError(504, f"calls still in flight after {timeout:.0f} s: not paused", "pause_timeout")
    # vLLM's own pause ends (abort) or freezes (keep) what it is generating and queues what reaches it
    # afterwards: calls still on their way when it paused run after resume, with the new weights.
    # Said every time: vLLM 0.32 clears by default in every mode, keep included (preempting every request in
    # flight to prefill it again), though its own documentation says keep ignores the flag.
    await admin.engine.call_all("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})
    if mode == "abort":  # let the aborted turns be recorded before a new version can be set
        await settled(admin, ABORT_QUIET, timeout, ABORT_FIRST)
    log.info("paused (%s)", mode)
    return await admin_state(admin)


def _idle(rows: list[ProcessRow]) -> bool:
    return not any(row.in_flight for row in rows)


def _opened(state: RunState) -> None:
    state.paused, state.pause_mode, state.paused_by = False, None, None


async def settled(admin: AdminContext, quiet: float, timeout: float, first: float) -> None:
    """Wait until calls stop ending on every process: none in flight, or none ended for `quiet` seconds (those
    left wait for something else, such as vLLM's queue), or, while none has ended yet, for `first` seconds;
    at most `timeout` seconds."""
    started = time.monotonic()
    ended_at, ended = started, None
    while True:
        rows = await admin.replica.alive()
        now = time.monotonic()
        total = sum(row.ended for row in rows)
        if ended is not None and total != ended:
            ended_at = now
        ended = total
        still = (quiet if ended_at > started else first) - (now - ended_at)
        if _idle(rows) or still <= 0 or now - started >= timeout:
            return
        await asyncio.sleep(min(still, 0.05))


async def resume(admin: AdminContext) -> AdminState:
    await admin.engine.call_all("/resume")
    await admin.replica.change(_opened)
    log.info("resumed at policy version %s", admin.recorder.policy_version)
    return await admin_state(admin)


async def set_policy_version(admin: AdminContext, version: str) -> AdminState:
    """New turns are stamped with `version` by every process; the backends tag their tokens with it too."""
    took: list[str] = []

    def versioned(state: RunState) -> None:
        state.policy_version = state.weight_version = version
        for entry in state.servers:
            if entry.url in took:
                entry.weight_version = version
            else:  # out of service until a health check has given it the version
                entry.healthy = False

    try:
        await admin.engine.call_all(WEIGHT_VERSION, json={"new_version": version}, done=_append_url_to(took))
    finally:  # also after a failure half way: the servers that took it hold it
        await admin.replica.change(versioned)
        await admin.store.publish_version(None, version)
    log.info("policy version is now %s", version)
    return await admin_state(admin)


async def reload_weights(admin: AdminContext) -> AdminState:
    """Every backend reloads its weights from its model directory (where the trainer has just written
    them)."""
    took: list[str] = []

    def reloaded(state: RunState) -> None:
        state.reloads += 1
        for entry in state.servers:
            if entry.url in took:
                entry.reloads = state.reloads
            else:  # out of service until a health check has given it the weights
                entry.healthy = False

    try:
        await admin.engine.call_all(RELOAD, json=RELOAD_BODY, done=_append_url_to(took))
    finally:
        await admin.replica.change(reloaded)
    log.info("backends reloaded their weights")
    return await admin_state(admin)


def _append_url_to(urls: list[str]) -> Callable[[Server], None]:
    return lambda server: urls.append(server.url)


async def publish_adapter(admin: AdminContext, policy: str, version: str, path: str) -> AdminState:
    """Load a LoRA policy's new version on its servers and make it the live one; retire and unload the
    versions past the keep window once no call holds them."""
    new = AdapterVersion(policy=policy, version=version, path=path)
    await adapters.publish(admin.replica, admin.fleet, admin.engine, new)
    await admin.store.publish_version(policy, version)
    await adapters.release(admin.replica, admin.fleet, admin.engine)
    return await admin_state(admin)


async def add_backend(admin: AdminContext, url: str) -> AdminState:
    """A server joins the fleet, checked at once (health, models) so that it takes rollouts if it is up."""
    url = url.rstrip("/")

    def added(state: RunState) -> None:
        entry = state.server(url)
        if entry is None:
            state.servers.append(ServerEntry(url=url))
        else:
            entry.draining = False

    await admin.replica.change(added)
    await publish.publish_health(admin.replica, await admin.engine.check(admin.fleet.servers[url]))
    return await admin_state(admin)


async def drain_backend(admin: AdminContext, url: str) -> AdminState:
    """No new rollouts go to the server; those pinned to it finish there."""

    def drained(state: RunState) -> None:
        _known(state, url).draining = True

    await _change_servers(admin, drained)
    server = admin.fleet.servers.get(url.rstrip("/"))
    if server is not None:
        log.info("backend %s draining: %d rollouts pinned", server.url, server.pinned)
    return await admin_state(admin)


async def remove_backend(admin: AdminContext, url: str) -> AdminState:
    """The server leaves: its rollouts move to others on their next call (calls in flight finish)."""

    def removed(state: RunState) -> None:
        entry = _known(state, url)
        if len(state.servers) == 1:
            raise ValueError(f"{entry.url} is the only backend: add another before removing it")
        state.servers.remove(entry)

    await _change_servers(admin, removed)
    return await admin_state(admin)


async def _change_servers(admin: AdminContext, edit: Callable[[RunState], None]) -> None:
    try:
        await admin.replica.change(edit)
    except KeyError as exc:
        known = ", ".join(entry.url for entry in admin.replica.held.servers)
        raise ApiError(
            404, f"no backend {exc.args[0]!r} (the gateway's: {known})", "backend_not_found"
        ) from None
    except ValueError as exc:
        raise ApiError(409, str(exc), "last_backend") from None


def _known(state: RunState, url: str) -> ServerEntry:
    entry = state.server(url.rstrip("/"))
    if entry is None:
        raise KeyError(url)
    return entry
