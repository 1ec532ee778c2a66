"""A worker process joining the others: it listens for them, takes the fleet from a running one (a restarted
process comes back paused if the gateway is), and leaves returning servers' weights to the leader."""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.state import GatewayState
from gateway.workers.fleet import Fleet, receive, weights_of
from gateway.workers.peers import Peers
from gateway.workers.routes import listen

log = logging.getLogger(__name__)


async def join_workers(state: GatewayState, peers: Peers) -> web.AppRunner:
    peers.leads()
    state.backends.gives_weights = peers.leads
    state.backends.caught_up = lambda server: peers.tell("/caught_up", weights_of(server).model_dump())
    listening = await listen(state, peers)
    running = [Fleet.model_validate(fleet) for fleet in await peers.ask("/fleet", strict=False)]
    if running:
        newest = max(running, key=lambda fleet: fleet.generation)
        receive(state, peers, newest, pause=True)
        log.info("worker joined %d running: policy version %s", len(running), state.recorder.policy_version)
    return listening
