"""Weight-sync coordination: the gateway and every vLLM backend pause, take a new version, resume."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from gateway.admin.protocol import AdminState, BackendView, WorkerView
from gateway.errors import ApiError
from gateway.state import GatewayState
from gateway.workers.fleet import Load, add_loads, load_of, share

log = logging.getLogger(__name__)

ABORT_QUIET = 2.0
"""An abort-mode pause returns once no call has ended for this many seconds: the aborted ones have been
recorded (under load their ends take a while to come through), and those left are queued in vLLM until the
resume."""
ABORT_FIRST = 10.0
"""How long an abort-mode pause waits for the first aborted call to end: with 200 streams on two cores the
first ends came through more than 2 s after vLLM's pause."""


async def admin_state(state: GatewayState) -> AdminState:
    mine = AdminState(
        paused=state.traffic.paused,
        in_flight=state.traffic.in_flight,
        waiting=state.traffic.waiting,
        policy_version=state.recorder.policy_version,
        backends=[BackendView.model_validate(server.view()) for server in state.backends.servers.values()],
        workers=[WorkerView.model_validate(load_of(state).worker())],
    )
    if state.peers is None:
        return mine
    loads = [Load.model_validate(load) for load in await state.peers.ask("/load")]
    return AdminState.model_validate(add_loads(mine.model_dump(), loads))


async def pause(state: GatewayState, mode: str, timeout: float) -> AdminState:
    """Hold new agent calls, then deal with those in flight as vLLM's own /pause does."""
    await _set_traffic(state, open_=False)
    if mode == "wait":
        try:
            drained = await _everywhere(
                state, state.traffic.drained(timeout), "/drained", {"timeout": timeout}, wait=timeout
            )
        except ApiError:
            await _reopen(state)
            raise
        if not drained:
            await _reopen(state)
            raise ApiError(504, f"calls still in flight after {timeout:.0f} s: not paused", "pause_timeout")
    # vLLM's own pause ends (abort) or freezes (keep) what it is generating and queues what reaches it
    # afterwards: calls still on their way when it paused run after resume, with the new weights.
    await state.backends.call_all("/pause", params={"mode": mode})
    if mode == "abort":  # let the aborted turns be recorded before a new version can be set
        await _everywhere(
            state,
            _settled(state, timeout),
            "/settled",
            {"quiet": ABORT_QUIET, "first": ABORT_FIRST, "timeout": timeout},
            wait=timeout,
        )
    log.info("paused (%s): %d calls in flight", mode, state.traffic.in_flight)
    return await admin_state(state)


async def resume(state: GatewayState) -> AdminState:
    await state.backends.call_all("/resume")
    await _set_traffic(state, open_=True)
    log.info("resumed at policy version %s", state.recorder.policy_version)
    return await admin_state(state)


async def set_policy_version(state: GatewayState, version: str) -> AdminState:
    """New turns are stamped with `version`; the backends tag their tokens with it too."""
    async with _shared(state):
        await state.backends.set_weight_version(version)
        state.recorder.policy_version = version
    log.info("policy version is now %s", version)
    return await admin_state(state)


async def reload_weights(state: GatewayState) -> AdminState:
    """Every backend reloads its weights from its model directory (where the trainer has just written
    them)."""
    async with _shared(state):
        await state.backends.reload_weights()
    log.info("backends reloaded their weights")
    return await admin_state(state)


async def add_backend(state: GatewayState, url: str) -> AdminState:
    """A server joins the fleet, checked at once (health, models) so that it takes rollouts if it is up."""
    async with _shared(state):
        await state.backends.check(state.backends.add(url))
    return await admin_state(state)


async def drain_backend(state: GatewayState, url: str) -> AdminState:
    async with _shared(state):
        _known(state, url, state.backends.drain)
    return await admin_state(state)


async def remove_backend(state: GatewayState, url: str) -> AdminState:
    async with _shared(state):
        _known(state, url, state.backends.remove)
    return await admin_state(state)


@asynccontextmanager
async def _shared(state: GatewayState) -> AsyncIterator[None]:
    """Hand this process's fleet (servers, weights, policy version) to the other worker processes after a
    change, also one that failed half way (some servers took new weights)."""
    try:
        yield
    finally:
        if state.peers is not None:
            await share(state, state.peers)


async def _set_traffic(state: GatewayState, *, open_: bool) -> None:
    """Open or close the door of every process; a close that some process missed is undone."""
    if open_:
        state.traffic.open()
    else:
        state.traffic.close()
    if state.peers is None:
        return
    try:
        await state.peers.ask("/traffic", {"open": open_})
    except ApiError:
        if not open_:
            await _reopen(state)
        raise


async def _reopen(state: GatewayState) -> None:
    """Undo a pause that did not take: every process that can be reached opens its door again."""
    state.traffic.open()
    if state.peers is not None:
        await state.peers.ask("/traffic", {"open": True}, strict=False)


async def _everywhere(
    state: GatewayState, mine: Awaitable[bool | None], path: str, body: dict[str, float], *, wait: float
) -> bool:
    """A pause step run in this process and in every other at once: whether it held in all of them."""
    if state.peers is None:
        return await mine is not False
    answers = await asyncio.gather(mine, state.peers.ask(path, body, wait=wait))
    return answers[0] is not False and all(answer.get("drained", True) for answer in answers[1])


async def _settled(state: GatewayState, timeout: float) -> None:
    await state.traffic.settled(ABORT_QUIET, timeout, ABORT_FIRST)


def _known(state: GatewayState, url: str, change: Callable[[str], object]) -> None:
    try:
        change(url)
    except KeyError:
        known = ", ".join(state.backends.urls)
        raise ApiError(404, f"no backend {url!r} (the gateway's: {known})", "backend_not_found") from None
    except ValueError as exc:
        raise ApiError(409, str(exc), "last_backend") from None
