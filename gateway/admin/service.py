"""Weight-sync coordination: the gateway and every vLLM backend pause, take a new version, resume."""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.admin.protocol import AdminState, BackendView
from gateway.errors import ApiError
from gateway.state import GatewayState

log = logging.getLogger(__name__)

ABORT_QUIET = 2.0
"""An abort-mode pause returns once no call has ended for this many seconds: the aborted ones have been
recorded (under load their ends take a while to come through), and those left are queued in vLLM until the
resume."""


def admin_state(state: GatewayState) -> AdminState:
    return AdminState(
        paused=state.traffic.paused,
        in_flight=state.traffic.in_flight,
        waiting=state.traffic.waiting,
        policy_version=state.recorder.policy_version,
        backends=[BackendView.model_validate(server.view()) for server in state.backends.servers.values()],
    )


async def pause(state: GatewayState, mode: str, timeout: float) -> AdminState:
    """Hold new agent calls, then deal with those in flight as vLLM's own /pause does."""
    state.traffic.close()
    if mode == "wait" and not await state.traffic.drained(timeout):
        state.traffic.open()
        raise ApiError(504, f"calls still in flight after {timeout:.0f} s: not paused", "pause_timeout")
    # vLLM's own pause ends (abort) or freezes (keep) what it is generating and queues what reaches it
    # afterwards: calls still on their way when it paused run after resume, with the new weights.
    await state.backends.call_all("/pause", params={"mode": mode})
    if mode == "abort":  # let the aborted turns be recorded before a new version can be set
        await state.traffic.settled(ABORT_QUIET, timeout)
    log.info("paused (%s): %d calls in flight", mode, state.traffic.in_flight)
    return admin_state(state)


async def resume(state: GatewayState) -> AdminState:
    await state.backends.call_all("/resume")
    state.traffic.open()
    log.info("resumed at policy version %s", state.recorder.policy_version)
    return admin_state(state)


async def set_policy_version(state: GatewayState, version: str) -> AdminState:
    """New turns are stamped with `version`; the backends tag their tokens with it too."""
    await state.backends.set_weight_version(version)
    state.recorder.policy_version = version
    log.info("policy version is now %s", version)
    return admin_state(state)


async def reload_weights(state: GatewayState) -> AdminState:
    """Every backend reloads its weights from its model directory (where the trainer has just written
    them)."""
    await state.backends.reload_weights()
    log.info("backends reloaded their weights")
    return admin_state(state)


async def add_backend(state: GatewayState, url: str) -> AdminState:
    """A server joins the fleet, checked at once (health, models) so that it takes rollouts if it is up."""
    await state.backends.check(state.backends.add(url))
    return admin_state(state)


def drain_backend(state: GatewayState, url: str) -> AdminState:
    _known(state, url, state.backends.drain)
    return admin_state(state)


def remove_backend(state: GatewayState, url: str) -> AdminState:
    _known(state, url, state.backends.remove)
    return admin_state(state)


def _known(state: GatewayState, url: str, change: Callable[[str], object]) -> None:
    try:
        change(url)
    except KeyError:
        known = ", ".join(state.backends.urls)
        raise ApiError(404, f"no backend {url!r} (the gateway's: {known})", "backend_not_found") from None
    except ValueError as exc:
        raise ApiError(409, str(exc), "last_backend") from None
