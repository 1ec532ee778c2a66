"""LoRA policies in process (`gateway.fleet.adapters`): a version published with POST /admin/adapters is
loaded on every server and serves its policy's calls under its own name; the agent gets the policy's name
back and the turn records the version; a server that cannot load it takes none of the policy's calls; the
versions past the keep window are unloaded once no call holds them."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.fleet.health import Found
from gateway.replicas.publish import publish_health
from gateway.turns.exact import RENDER
from trainer_client import SampleOptions, TrainerClient

import support
from support.fake_engine import HeldReply, chat_reply, chat_stream, json_reply

pytestmark = pytest.mark.anyio
A, B = "http://vllm-a:8000", "http://vllm-b:8000"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
CHAT = "/v1/chat/completions"


async def started(start, servers: list[str], **settings: Any) -> Any:
    """A gateway whose servers serve `tiny`, as their health checks found them, with the LoRA policy
    `agent` on it."""
    gw = await start(**({"backend": servers, "lora_policy": ["agent=tiny"]} | settings))
    await publish_health(
        gw.app.state.admin.replica, *(Found(url, frozenset({"tiny"}), None) for url in servers)
    )
    return gw


@pytest.fixture
async def gw(start):
    return await started(start, [A, B])


async def publish(gw, version: str, path: str | None = None, policy: str = "agent") -> Any:
    body = {"policy": policy, "version": version, "path": path or f"/adapters/{policy}-{version}"}
    return await gw.client.post("/admin/adapters", json=body)


async def published(gw, version: str) -> dict[str, Any]:
    answer = await publish(gw, version)
    assert answer.status_code == 200, answer.text
    return answer.json()


def asked(gw, path: str) -> list[Any]:
    """What the servers were sent at `path` (a server's URL and path for loads), in order."""
    return [body for at, body in gw.engine.requests if at == path]


def adapters(state: dict[str, Any]) -> list[tuple[str, bool, bool, list[str]]]:
    return [(a["name"], a["live"], a["retired"], a["backends"]) for a in state["adapters"]]


async def test_a_call_of_a_lora_policy_before_its_first_version_is_refused_and_recorded_as_such(gw):
    answer = await gw.chat("r1", model="agent")

    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "no_adapter_version"
    assert answer.json()["error"]["message"] == (
        "LoRA policy 'agent' has no version yet: publish one with POST /admin/adapters"
    )
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["status"], turn["http_status"], turn["adapter"]) == ("error", 503, None)
    assert asked(gw, CHAT) == []


async def test_a_published_version_is_loaded_on_every_server_under_a_name_of_its_own(gw):
    state = await published(gw, "1")

    assert asked(gw, A + LOAD) == [{"lora_name": "agent@1-c1dcfbda", "lora_path": "/adapters/agent-1"}]
    assert asked(gw, B + LOAD) == [{"lora_name": "agent@1-c1dcfbda", "lora_path": "/adapters/agent-1"}]
    assert adapters(state) == [("agent@1-c1dcfbda", True, False, [A, B])]
    assert state["adapters"][0] | {"backends": None} == {
        "policy": "agent",
        "version": "1",
        "name": "agent@1-c1dcfbda",
        "path": "/adapters/agent-1",
        "live": True,
        "retired": False,
        "calls": 0,
        "backends": None,
    }


async def test_a_policys_call_runs_on_its_live_version_and_the_agent_gets_the_policys_name(gw):
    await published(gw, "1")
    await published(gw, "2")
    gw.engine.answer(CHAT, chat_reply([4, 5], [10, 0], "a"))

    answer = await gw.chat("r1", model="agent")

    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "agent"
    assert asked(gw, CHAT)[0]["model"] == "agent@2-6e701aca"
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["model"], turn["adapter"], turn["policy_version"], turn["policy_version_end"]) == (
        "agent",
        "agent@2-6e701aca",
        "2",
        "2",
    )


async def test_every_chunk_of_a_streamed_call_names_the_policy(gw):
    await published(gw, "1")
    gw.engine.answer(CHAT, chat_stream([4], [(10, "a"), (11, "b"), (0, "")]))

    answer = await gw.chat("r1", model="agent", stream=True)

    events = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: {")]
    assert [orjson.loads(event)["model"] for event in events] == ["agent"] * 4


async def test_a_call_of_the_base_model_runs_on_its_own_weights(gw):
    await published(gw, "1")
    gw.engine.answer(CHAT, chat_reply([4], [10, 0], "a"))

    answer = await gw.chat("r1", model="tiny")

    assert (answer.json()["model"], asked(gw, CHAT)[0]["model"]) == ("tiny", "tiny")
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["adapter"], turn["policy_version"]) == (None, "0")


async def test_a_server_that_cannot_load_a_version_takes_none_of_its_policys_calls(gw):
    gw.engine.fail(B + LOAD, f"{B}{LOAD}: HTTP 400 LoRA rank 16 is greater than max_lora_rank 8")
    state = await published(gw, "1")
    for rollout in ("r1", "r2", "r3", "r4"):
        gw.engine.answer(CHAT, chat_reply([4], [10, 0], "a"))
        assert (await gw.chat(rollout, model="agent")).status_code == 200

    assert adapters(state) == [("agent@1-c1dcfbda", True, False, [A])]
    errors = {backend["url"]: backend["adapter_errors"] for backend in state["backends"]}
    assert errors == {
        A: {},
        B: {"agent@1-c1dcfbda": f"{B}{LOAD}: HTTP 400 LoRA rank 16 is greater than max_lora_rank 8"},
    }
    backends = [(await gw.rollout(r))["turns"][0]["backend"] for r in ("r1", "r2", "r3", "r4")]
    assert backends == [A, A, A, A]


async def test_a_version_no_server_can_load_is_refused_with_their_reasons_and_the_live_one_stays(gw):
    await published(gw, "1")
    gw.engine.fail(A + LOAD, f"{A}{LOAD}: HTTP 404 not found")
    gw.engine.fail(B + LOAD, f"{B}{LOAD}: HTTP 404 not found")

    answer = await publish(gw, "2")

    assert answer.status_code == 502
    assert answer.json()["error"] | {"message": None} == {
        "message": None,
        "type": "server_error",
        "param": None,
        "code": "not_loaded",
    }
    assert answer.json()["error"]["message"] == (
        f"no backend could load agent@2-6e701aca from /adapters/agent-2: {A}{LOAD}: HTTP 404 not found; "
        f"{B}{LOAD}: HTTP 404 not found"
    )
    state = (await gw.client.get("/admin/state")).json()
    assert adapters(state) == [("agent@1-c1dcfbda", True, False, [A, B])]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"policy": "judge", "version": "1", "path": "/adapters/j"}, 404, "policy_not_found"),
        ({"policy": "agent", "version": "1", "path": "/adapters/other"}, 409, "version_exists"),
        ({"policy": "agent", "version": "2", "path": "/adapters/agent-1"}, 409, "path_published"),
        ({"policy": "agent", "version": "2"}, 422, "invalid_request"),
        ({"policy": "agent", "version": "two words", "path": "/adapters/x"}, 422, "invalid_request"),
        ({"policy": "agent", "version": "2", "path": ""}, 422, "invalid_request"),
    ],
)
async def test_a_publish_the_gateway_cannot_take_is_refused_and_changes_nothing(gw, body, status, code):
    await published(gw, "1")
    loads = len(asked(gw, A + LOAD))

    answer = await gw.client.post("/admin/adapters", json=body)

    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    assert len(asked(gw, A + LOAD)) == loads
    state = (await gw.client.get("/admin/state")).json()
    assert adapters(state) == [("agent@1-c1dcfbda", True, False, [A, B])]


async def test_versions_past_the_keep_window_are_unloaded_from_every_server(gw):
    for version in ("1", "2", "3"):
        state = await published(gw, version)

    assert adapters(state) == [
        ("agent@2-6e701aca", False, False, [A, B]),
        ("agent@3-cf916602", True, False, [A, B]),
    ]
    assert asked(gw, A + UNLOAD) == asked(gw, B + UNLOAD) == [{"lora_name": "agent@1-c1dcfbda"}]


async def test_a_retired_version_stays_loaded_until_its_last_call_ends(start):
    gw = await started(start, [A], lora_keep=1, health_interval=0.05)
    await published(gw, "1")
    release = asyncio.Event()
    gw.engine.answer(CHAT, HeldReply(chat_stream([4], [(10, "a"), (0, "")]), release))
    held = asyncio.create_task(gw.chat("r1", model="agent", stream=True))
    await support.until(lambda: gw.app.state.turns.traffic.in_flight == 1, "the call in flight")

    state = await published(gw, "2")

    assert adapters(state) == [("agent@1-c1dcfbda", False, True, [A]), ("agent@2-6e701aca", True, False, [A])]
    assert [a["calls"] for a in state["adapters"]] == [1, 0]
    assert asked(gw, A + UNLOAD) == []
    release.set()
    assert (await held).status_code == 200
    await support.until(
        lambda: asked(gw, A + UNLOAD) == [{"lora_name": "agent@1-c1dcfbda"}], "agent@1-c1dcfbda unloaded"
    )
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["adapter"], turn["policy_version"], turn["policy_version_end"]) == (
        "agent@1-c1dcfbda",
        "1",
        "1",
    )


async def played(gw, group: str, model: str, reward: float, **created: Any) -> str:
    """A rollout of `group` created (with `created`), one call of `model`, finished with `reward`."""
    made = await gw.client.post("/rollouts", json={"group_id": group, **created})
    rollout = made.json()["rollout_id"]
    gw.engine.answer(CHAT, chat_reply([4], [10, 0], "a"))
    assert (await gw.chat(rollout, model=model)).status_code == 200
    assert (await gw.client.post(f"/rollouts/{rollout}/finish", json={"reward": reward})).status_code == 200
    return rollout


async def test_a_rollout_trains_the_policy_it_declares_else_the_model_of_its_first_call(start):
    gw = await started(start, [A], lora_policy=["agent=tiny", "judge=tiny"])
    for policy in ("agent", "judge"):
        assert (await publish(gw, "1", policy=policy)).status_code == 200

    declared = await played(gw, "g1", "agent", 1.0, policy="judge")
    undeclared = await played(gw, "g2", "agent", 1.0)
    base = await played(gw, "g3", "tiny", 1.0)

    rollouts = [await gw.rollout(r) for r in (declared, undeclared, base)]
    assert [(r["policy"], r["turns"][0]["adapter"]) for r in rollouts] == [
        ("judge", "agent@1-c1dcfbda"),
        ("agent", "agent@1-c1dcfbda"),
        ("tiny", None),
    ]


async def test_a_trainer_claims_only_the_groups_of_the_policy_it_asks_for(start):
    gw = await started(start, [A], lora_policy=["agent=tiny", "judge=tiny"])
    for policy in ("agent", "judge"):
        assert (await publish(gw, "1", policy=policy)).status_code == 200
    for group, model in (("g-agent", "agent"), ("g-judge", "judge")):
        for reward in (0.0, 1.0):
            await played(gw, group, model, reward)

    with TrainerClient(gw.db) as client:
        judged = client.claim("judge-trainer", 0, SampleOptions(policy="judge"))
        agents = client.claim("agent-trainer", 0, SampleOptions(policy="agent"))
        none_left = client.claim("agent-trainer", 1, SampleOptions(policy="agent"))

    assert {s.group_id for s in judged.samples} == {"g-judge"}
    assert {s.group_id for s in agents.samples} == {"g-agent"}
    assert (len(judged.samples), len(agents.samples), none_left.samples) == (2, 2, [])


async def test_metrics_and_readiness_show_the_live_version_and_the_servers_that_could_not_load_it(gw):
    gw.engine.fail(B + LOAD, "rank 16 is greater than max_lora_rank 8")
    await published(gw, "1")

    lines = (await gw.client.get("/metrics")).text.splitlines()
    ready = (await gw.client.get("/readyz")).json()

    assert [
        line for line in lines if line.startswith(("gateway_lora", "gateway_backend_adapter_errors{"))
    ] == [
        'gateway_backend_adapter_errors{backend="http://vllm-a:8000"} 0.0',
        'gateway_backend_adapter_errors{backend="http://vllm-b:8000"} 1.0',
        'gateway_lora_version_info{adapter="agent@1-c1dcfbda",policy="agent",version="1"} 1.0',
        'gateway_lora_backends_healthy{policy="agent"} 1.0',
    ]
    servers = ready["backends"]["servers"]
    assert (servers[A]["adapter_errors"], servers[B]["adapter_errors"]) == (
        {},
        {"agent@1-c1dcfbda": "rank 16 is greater than max_lora_rank 8"},
    )


async def test_an_exact_mode_call_of_a_lora_policy_renders_and_runs_on_its_live_version(start):
    gw = await started(start, [A], mode="exact")
    gw.engine.exact = True
    await published(gw, "1")
    gw.engine.answer(RENDER, json_reply({"token_ids": [1, 10, 2], "sampling_params": {"max_tokens": 16}}))
    gw.engine.answer(CHAT, chat_reply([1, 10, 2], [40, 2], "hi"))

    answer = await gw.chat("r1", model="agent")

    assert (answer.status_code, answer.json()["model"]) == (200, "agent")
    (render, rendered), (chat, sent) = [(p, b) for p, b in gw.engine.requests if p in (RENDER, CHAT)]
    assert (render, rendered["model"], chat, sent["model"]) == (
        RENDER,
        "agent@1-c1dcfbda",
        CHAT,
        "agent@1-c1dcfbda",
    )
    assert sent["kv_transfer_params"] == {"prompt_token_ids": [1, 10, 2]}
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["splice"], turn["adapter"], turn["prompt_token_ids"]) == (
        "render",
        "agent@1-c1dcfbda",
        [1, 10, 2],
    )


async def test_agents_see_a_published_lora_policy_among_the_models_and_not_its_versions_names(gw):
    unpublished = (await gw.client.get("/rollouts/r1/v1/models")).json()
    await published(gw, "1")

    listed = (await gw.client.get("/rollouts/r1/v1/models")).json()

    assert [card["id"] for card in unpublished["data"]] == ["tiny"]
    assert [(card["id"], card.get("parent")) for card in listed["data"]] == [
        ("tiny", None),
        ("agent", "tiny"),
    ]


async def test_a_server_that_cannot_load_a_version_takes_none_of_its_calls_before_its_models_are_listed(
    start,
):
    """Published before any health check listed the servers' models (each would serve any model): the one
    whose load failed still takes none of the policy's calls, and says why when no other server is left."""
    gw = await start(backend=[A, B], lora_policy=["agent=tiny"])
    gw.engine.fail(B + LOAD, f"{B}{LOAD}: HTTP 500 LoRA rank 16 is greater than max_lora_rank 8")
    await published(gw, "1")
    rollouts = ["r1", "r2", "r3", "r4"]
    for rollout in rollouts:
        gw.engine.answer(CHAT, chat_reply([4], [10, 0], "a"))
        assert (await gw.chat(rollout, model="agent")).status_code == 200
    (await gw.client.post("/admin/backends/drain", json={"url": A})).raise_for_status()

    refused = await gw.chat("r5", model="agent")

    backends = [(await gw.rollout(r))["turns"][0]["backend"] for r in rollouts]
    assert backends == [A, A, A, A]
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == (
        f"no healthy backend takes new rollouts for model 'agent@1-c1dcfbda': {A} (draining), "
        f"{B} (failed to load it)"
    )
