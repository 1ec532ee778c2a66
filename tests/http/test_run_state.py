"""How a gateway process holds the run state (`gateway.replicas`): each server's health, models and weights,
the servers, the pause and the policy version are the run state's, an older state arriving late changes
nothing, health checks' findings become the run state's, and the leading process publishes the servers a
`--backend-file` lists."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.fleet.fleet import Fleet
from gateway.fleet.health import Found
from gateway.fleet.weight_versions import FleetWeights
from gateway.replicas.publish import listed, publish_health
from gateway.replicas.replica import Replica
from gateway.store.run_state import RunState, ServerEntry
from gateway.turns.recording import Recorder
from gateway.turns.traffic import Traffic

pytestmark = pytest.mark.anyio
A, B, C = "http://vllm-a:8000", "http://vllm-b:8000", "http://vllm-c:8000"


@dataclass(frozen=True)
class Worker:
    """The parts of a gateway process's app that hold the run state."""

    replica: Replica
    fleet: Fleet
    recorder: Recorder
    traffic: Traffic


@pytest.fixture
def start_worker(tmp_path: Path, start: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Worker]]:
    """`await start_worker()`: one process's state over servers A and B (both in service, with `backend_file`
    listed in a file)."""

    async def started(*, backend_file: bool = False) -> Worker:
        listed = tmp_path / "servers"
        listed.write_text(f"{A}\n{B}\n")
        app = (await start(backend=[A, B], backend_file=str(listed) if backend_file else None)).app
        admin = app.state.admin
        return Worker(admin.replica, admin.fleet, admin.recorder, app.state.turns.traffic)

    return started


@pytest.fixture
async def worker(start_worker) -> Worker:
    return await start_worker()


def run_state(epoch: int, *servers: ServerEntry, paused: bool = False, version: str = "3") -> RunState:
    return RunState(
        epoch=epoch,
        paused=paused,
        policy_version=version,
        reloads=1,
        weight_version=version,
        servers=list(servers),
    )


def entry(
    url: str,
    *,
    healthy: bool = True,
    models: tuple[str, ...] = (),
    reloads: int = 1,
    version: str | None = "3",
    draining: bool = False,
) -> ServerEntry:
    return ServerEntry(
        url=url,
        draining=draining,
        healthy=healthy,
        models=list(models),
        reloads=reloads,
        weight_version=version,
    )


def held(state: Worker) -> list[tuple[str, bool, bool, list[str], int, str | None]]:
    """Each server as the process holds it: url, healthy, draining, models, reloads, weight version."""
    return [
        (s.url, s.healthy, s.draining, sorted(s.models), s.reloads, s.weight_version)
        for s in state.fleet.servers.values()
    ]


async def test_a_process_holds_each_servers_health_models_and_weights_as_the_run_state_says(worker):
    state = worker

    state.replica.adopt_if_newer(
        run_state(1, entry(A, models=("tiny",)), entry(B, healthy=False, reloads=0, version=None))
    )

    assert held(state) == [(A, True, False, ["tiny"], 1, "3"), (B, False, False, [], 0, None)]
    assert (state.recorder.policy_version, state.fleet.weights) == ("3", FleetWeights(1, "3"))


async def test_an_older_run_state_arriving_late_changes_nothing(worker):
    state = worker
    state.replica.adopt_if_newer(run_state(2, entry(A), entry(B), version="3"))

    state.replica.adopt_if_newer(run_state(1, entry(A, version="2"), version="2"))

    assert (state.recorder.policy_version, sorted(state.fleet.servers), state.replica.held.epoch) == (
        "3",
        [A, B],
        2,
    )


async def test_servers_join_drain_and_leave_as_the_run_state_says(worker):
    state = worker

    state.replica.adopt_if_newer(run_state(1, entry(A, draining=True), entry(C, healthy=False)))

    assert held(state) == [(A, True, True, [], 1, "3"), (C, False, False, [], 1, "3")]


async def test_the_pause_is_the_run_states(worker):
    state = worker

    state.replica.adopt_if_newer(run_state(1, entry(A), entry(B), paused=True))
    assert state.traffic.paused is True
    state.replica.adopt_if_newer(run_state(2, entry(A), entry(B)))

    assert state.traffic.paused is False


async def test_health_checks_findings_become_the_run_states_and_finding_nothing_new_changes_nothing(
    worker,
):
    state = worker
    epoch = state.replica.held.epoch
    ejected = Found(A, models=frozenset({"tiny"}), prefix_cache_hit_rate=0.5, healthy=False)

    await publish_health(state.replica, ejected)
    await publish_health(state.replica, ejected)

    assert held(state)[0] == (A, False, False, ["tiny"], 0, None)
    await publish_health(state.replica, Found(A, models=frozenset({"tiny"}), prefix_cache_hit_rate=0.5))
    assert held(state)[0] == (A, False, False, ["tiny"], 0, None)  # a check that changed nothing
    admitted = Found(A, frozenset({"tiny"}), 0.5, healthy=True, weights=FleetWeights(2, "4"))
    await publish_health(state.replica, admitted)
    assert held(state)[0] == (A, True, False, ["tiny"], 2, "4")
    assert state.fleet.servers[A].prefix_cache_hit_rate == 0.5
    assert state.replica.held.epoch == epoch + 2


async def test_with_a_backend_file_the_leading_process_makes_the_servers_those_it_lists(start_worker):
    state = await start_worker(backend_file=True)

    await listed(state.replica, [A, C])

    assert held(state) == [(A, True, False, [], 0, None), (C, False, False, [], 0, None)]
