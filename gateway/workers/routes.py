"""What a worker process answers the others, on its unix socket only (never on the gateway's port): its part
of the fleet and the load, and the pause steps, which the process that received an admin call runs on every
process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from gateway.metrics import samples
from gateway.state import GatewayState
from gateway.workers.fleet import Fleet, ServerWeights, fleet_of, load_of, receive, take_weights
from gateway.workers.peers import Peers

Handler = Callable[[GatewayState, Any], Awaitable[object]]


async def _fleet(state: GatewayState, _body: None) -> object:
    return fleet_of(state, _peers(state).generation).model_dump()


async def _receive(state: GatewayState, body: dict[str, Any]) -> object:
    receive(state, _peers(state), Fleet.model_validate(body))
    return {}


async def _caught_up(state: GatewayState, body: dict[str, Any]) -> object:
    take_weights(state, ServerWeights.model_validate(body))
    return {}


async def _load(state: GatewayState, _body: None) -> object:
    return load_of(state).model_dump()


async def _traffic(state: GatewayState, body: dict[str, Any]) -> object:
    if body["open"]:
        state.traffic.open()
    else:
        state.traffic.close()
    return {}


async def _drained(state: GatewayState, body: dict[str, Any]) -> object:
    return {"drained": await state.traffic.drained(float(body["timeout"]))}


async def _settled(state: GatewayState, body: dict[str, Any]) -> object:
    await state.traffic.settled(float(body["quiet"]), float(body["timeout"]), float(body["first"]))
    return {}


async def _forget(state: GatewayState, body: dict[str, Any]) -> object:
    state.backends.forget(str(body["rollout_id"]))
    return {}


async def _metrics(state: GatewayState, _body: None) -> object:
    state.metrics.commits.set(state.store.commits)
    return samples(state.metrics.registry)


_ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/fleet", _fleet),
    ("POST", "/fleet", _receive),
    ("POST", "/caught_up", _caught_up),
    ("GET", "/load", _load),
    ("POST", "/traffic", _traffic),
    ("POST", "/drained", _drained),
    ("POST", "/settled", _settled),
    ("POST", "/forget", _forget),
    ("GET", "/metrics", _metrics),
]


def _peers(state: GatewayState) -> Peers:
    assert state.peers is not None, "served only to the other workers"
    return state.peers


def _route(state: GatewayState, handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def answer(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read()) if request.can_read_body else None
        return web.Response(body=orjson.dumps(await handler(state, body)), content_type="application/json")

    return answer


async def listen(state: GatewayState, peers: Peers) -> web.AppRunner:
    """Serve the other processes on this one's socket, readable by this user only."""
    app = web.Application()
    for method, path, handler in _ROUTES:
        app.router.add_route(method, path, _route(state, handler))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(peers.socket)).start()
    peers.socket.chmod(0o600)
    return runner
