"""`gateway serve --workers 2` on PostgreSQL: both processes serve the one port, an admin call made through
the port reaches both (pause, policy version), the gateway's counts are both processes' added up, and a
worker that dies is replaced by one that takes the gateway's state (the processes share it through the
store, as replicas on several hosts do: `tests/engine/test_replica_fleet.py`)."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from typing import Any

import httpx
import pytest

from support import TIMEOUT, admin, metric, stored_rollout, sync_agent, wait_for

pytestmark = pytest.mark.engine


@pytest.fixture
def workers(start_gateway, databases):
    gateway = start_gateway(databases.new("postgresql"), "--workers", "2", process=True)
    wait_for(lambda: len(by_worker(gateway, "pid")) == 2)
    return gateway


def call(gateway: Any, rollout_id: str) -> None:
    """One agent call on a connection of its own, so that either worker may take it."""
    with sync_agent(gateway.agent_url(rollout_id)) as agent:
        agent.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"min_tokens": 2},
        )


def by_worker(gateway: Any, field: str) -> dict[int, Any]:
    """`field` of each live process."""
    return {w["pid"]: w[field] for w in admin(gateway, "/state").json()["workers"] if w["alive"]}


def both_served(gateway: Any) -> bool:
    """Whether each worker has served a call, as the one answering sees it (the other's count is that of its
    last heartbeat)."""
    return all(by_worker(gateway, "requests").values())


def test_both_workers_serve_and_the_gateway_counts_their_calls_once(workers):
    rollouts = [f"spread-{i}" for i in range(30)]
    made = 0
    for rollout_id in rollouts:  # until each worker has taken calls (the kernel picks who accepts)
        call(workers, rollout_id)
        call(workers, rollout_id)
        made += 2
        if both_served(workers):
            break
    wait_for(lambda: both_served(workers), f"both workers seen serving {made} calls")

    # the other process's numbers are those of its last heartbeat
    wait_for(lambda: [b["requests"] for b in admin(workers, "/state").json()["backends"]] == [made])
    state = admin(workers, "/state").json()
    wait_for(lambda: [b["pinned"] for b in admin(workers, "/state").json()["backends"]] == [made // 2])
    wait_for(lambda: metric(workers, 'gateway_requests_total{endpoint="chat",status="200"}') == made)
    assert metric(workers, "gateway_backend_healthy{backend=" + f'"{state["backends"][0]["url"]}"' + "}") == 1

    for rollout_id in rollouts[: made // 2]:
        httpx.post(
            f"{workers.url}/rollouts/{rollout_id}/finish", json={"reward": 1.0}, timeout=TIMEOUT
        ).raise_for_status()
    wait_for(lambda: [b["pinned"] for b in admin(workers, "/state").json()["backends"]] == [0])


def test_a_pause_through_the_port_holds_calls_on_every_worker_and_its_version_reaches_all(workers):
    assert admin(workers, "/pause").json()["paused"] is True
    held: list[threading.Thread] = []
    failures: list[BaseException] = []

    def agent(rollout_id: str) -> None:
        try:
            call(workers, rollout_id)
        except BaseException as exc:  # reported by the assertion below
            failures.append(exc)

    rollouts = []
    while not all(by_worker(workers, "waiting").values()):  # each worker holds at least one call
        assert len(held) < 30, "one worker took every connection"
        rollouts.append(f"held-{uuid.uuid4().hex[:8]}")
        held.append(threading.Thread(target=agent, args=(rollouts[-1],)))
        held[-1].start()
        wait_for(lambda: admin(workers, "/state").json()["waiting"] == len(held))

    assert admin(workers, "/policy_version", json={"version": "7"}).status_code == 200
    resumed = admin(workers, "/resume").json()
    for thread in held:
        thread.join(timeout=60)

    assert (resumed["paused"], resumed["policy_version"], failures) == (False, "7", [])
    assert [stored_rollout(workers, r)["turns"][0]["policy_version"] for r in rollouts] == ["7"] * len(
        rollouts
    )


def test_a_killed_worker_is_replaced_by_one_that_takes_the_gateways_version(workers):
    admin(workers, "/policy_version", json={"version": "5"}).raise_for_status()
    killed = sorted(by_worker(workers, "requests"))[0]
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: len(pids := by_worker(workers, "requests")) == 2 and killed not in pids)

    epoch = admin(workers, "/state").json()["epoch"]
    assert set(by_worker(workers, "applied_epoch").values()) == {epoch}  # the new worker holds the fleet too
    rollouts = [f"after-{i}" for i in range(6)]
    for rollout_id in rollouts:
        call(workers, rollout_id)
    assert [stored_rollout(workers, r)["turns"][0]["policy_version"] for r in rollouts] == ["5"] * len(
        rollouts
    )
