"""A worker process joining the others: it listens for them, takes the fleet from a running one (a restarted
process comes back paused if the gateway is), and leaves returning servers' weights to the leader."""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.state import GatewayState
from gateway.workers.fleet import Fleet, adopt, fleet_of
from gateway.workers.peers import Peers
from gateway.workers.routes import listen

log = logging.getLogger(__name__)


async def join_workers(state: GatewayState, peers: Peers) -> web.AppRunner:
    listening = await listen(state, peers)
    running = await peers.ask("/fleet")
    if running:
        await adopt(state, Fleet.model_validate(running[0]), pause=True)
        log.info("worker joined %d running: policy version %s", len(running), state.recorder.policy_version)
    peers.leads()
    state.backends.gives_weights = peers.leads
    state.backends.caught_up = lambda: peers.tell("/fleet", fleet_of(state).model_dump())
    return listening
