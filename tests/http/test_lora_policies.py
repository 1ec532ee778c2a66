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
from gateway.replicas.publish import found

import support
from support.fake_engine import HeldReply, chat_reply, chat_stream

pytestmark = pytest.mark.anyio
A, B = "http://vllm-a:8000", "http://vllm-b:8000"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
CHAT = "/v1/chat/completions"


async def started(start, servers: list[str], **settings: Any) -> Any:
    """A gateway whose servers serve `tiny`, as their health checks found them, with the LoRA policy
    `agent` on it."""
    gw = await start(backend=servers, lora_policy=["agent=tiny"], **settings)
    await found(gw.app.state.admin.replica, *(Found(url, frozenset({"tiny"}), None) for url in servers))
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
