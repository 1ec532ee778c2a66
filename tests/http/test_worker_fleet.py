"""How a worker process takes the fleet another one hands it (`gateway serve --workers`): a server behind the
fleet's weights leaves service, an older fleet arriving late changes nothing, a joining worker starts paused
if the gateway is, and a `--backend-file` keeps the say over which servers there are."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.backend import BackendPool
from gateway.settings import Settings
from gateway.state import GatewayState
from gateway.store.store import Store
from gateway.workers.fleet import Fleet, ServerWeights, receive
from gateway.workers.peers import Peers

pytestmark = pytest.mark.anyio
A, B, C = "http://vllm-a:8000", "http://vllm-b:8000", "http://vllm-c:8000"


@pytest.fixture
async def start_worker(
    tmp_path: Path, empty_store: Path
) -> AsyncIterator[Callable[..., Awaitable[tuple[GatewayState, Peers]]]]:
    """`await start_worker()`: one worker's state over servers A and B (both in service, with `backend_file`
    listed in a file), and its view of the other workers."""
    async with AsyncExitStack() as stack:

        async def start(*, backend_file: bool = False) -> tuple[GatewayState, Peers]:
            db = tmp_path / "gateway.db"
            db.write_bytes(empty_store.read_bytes())
            listed = tmp_path / "servers"
            listed.write_text(f"{A}\n{B}\n")
            settings = Settings(
                db=f"sqlite:///{db}", backend=[A, B], backend_file=str(listed) if backend_file else None
            )
            store = Store(settings.db)
            stack.callback(store.close)
            pool = BackendPool([A, B], timeout=5, connect_timeout=1, max_connections=4)
            stack.push_async_callback(pool.close)
            app = create_app(settings, store=store, backends=pool)
            await stack.enter_async_context(app.router.lifespan_context(app))
            peers = Peers(tmp_path)
            stack.push_async_callback(peers.close)
            return app.state.gateway, peers

        yield start


@pytest.fixture
async def worker(start_worker) -> tuple[GatewayState, Peers]:
    return await start_worker()


def fleet(generation: int, *servers: ServerWeights, paused: bool = False, version: str = "3") -> Fleet:
    return Fleet(
        generation=generation,
        paused=paused,
        policy_version=version,
        reloads=1,
        weight_version=version,
        servers=list(servers),
    )


def weights(url: str, reloads: int = 1, version: str | None = "3", draining: bool = False) -> ServerWeights:
    return ServerWeights(url=url, draining=draining, reloads=reloads, weight_version=version)


async def test_a_server_behind_the_fleets_weights_leaves_service_until_it_has_them(worker):
    state, peers = worker

    receive(state, peers, fleet(1, weights(A), weights(B, reloads=0, version=None)))

    servers = state.backends.servers
    assert (servers[A].healthy, servers[B].healthy) == (True, False)
    assert (state.recorder.policy_version, state.backends.reloads, state.backends.weight_version) == (
        "3",
        1,
        "3",
    )


async def test_an_older_fleet_arriving_late_changes_nothing(worker):
    state, peers = worker
    receive(state, peers, fleet(2, weights(A), weights(B), version="3"))

    receive(state, peers, fleet(1, weights(A, version="2"), version="2"))

    assert (state.recorder.policy_version, sorted(state.backends.servers), peers.generation) == (
        "3",
        [A, B],
        2,
    )


async def test_servers_join_drain_and_leave_as_the_fleet_says(worker):
    state, peers = worker

    receive(state, peers, fleet(1, weights(A, draining=True), weights(C)))

    servers = state.backends.servers
    assert sorted(servers) == [A, C]
    assert (servers[A].draining, servers[C].draining) == (True, False)


async def test_a_joining_worker_takes_the_pause_and_a_running_one_keeps_its_own(worker):
    state, peers = worker

    receive(state, peers, fleet(1, weights(A), weights(B), paused=True))
    assert state.traffic.paused is False  # only a joining process takes the pause from the fleet
    receive(state, peers, fleet(2, weights(A), weights(B), paused=True), pause=True)

    assert state.traffic.paused is True


async def test_with_a_backend_file_the_servers_stay_those_it_lists(start_worker):
    state, peers = await start_worker(backend_file=True)

    receive(state, peers, fleet(1, weights(A, draining=True), weights(C)))

    assert sorted(state.backends.servers) == [A, B]
    assert state.backends.servers[A].draining is True
