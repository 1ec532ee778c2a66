"""Weight-sync coordination: pause, new policy version, resume, across the gateway and vLLM."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from support import TIMEOUT, VLLM_KEY, admin, engine_metric, stored_rollout, sync_agent

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "min_tokens": 3}


@pytest.fixture
def fresh(start_gateway, databases, db_kind):
    def start(*args: str):
        db_url = databases.new(db_kind)
        return start_gateway(db_url, *args), db_url

    return start


def test_pause_holds_new_calls_until_resume(fresh, rollout_id):
    gateway, _db_url = fresh()
    paused = admin(gateway, "/pause", json={"mode": "wait"}).json()
    done = threading.Event()

    def call() -> None:
        httpx.post(
            gateway.agent_url(rollout_id) + "/chat/completions", json=CHAT, timeout=TIMEOUT
        ).raise_for_status()
        done.set()

    caller = threading.Thread(target=call)
    try:
        caller.start()
        assert not done.wait(1.5)
        assert admin(gateway, "/state").json()["paused"] is True
    finally:
        resumed = admin(gateway, "/resume").json()
    caller.join(60)

    assert (paused["paused"], resumed["paused"]) == (True, False)
    assert done.is_set()
    assert [t["status"] for t in stored_rollout(gateway, rollout_id)["turns"]] == ["ok"]
    assert admin(gateway, "/state").json()["in_flight"] == 0


def test_new_policy_version_stamps_the_turns_that_follow(fresh, rollout_id):
    gateway, _db_url = fresh("--policy-version", "3")
    url = gateway.agent_url(rollout_id) + "/chat/completions"
    httpx.post(url, json=CHAT, timeout=TIMEOUT)
    try:
        state = admin(gateway, "/policy_version", json={"version": "4"}).json()
        httpx.post(url, json=CHAT, timeout=TIMEOUT)
    finally:
        admin(gateway, "/policy_version", json={"version": "default"})

    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert state["policy_version"] == "4"
    assert [(t["policy_version"], t["policy_version_end"]) for t in turns] == [("3", "3"), ("4", "4")]


def preemptions(vllm) -> float:
    """How many running requests vLLM has preempted (to compute them again) since it started."""
    return engine_metric(vllm, "vllm:num_preemptions_total")


@pytest.mark.parametrize("clear_cache", [True, False], ids=["cache cleared", "cache kept"])
def test_streamed_turn_survives_a_keep_mode_weight_update_and_records_its_versions_and_the_caches_fate(
    fresh, rollout_id, vllm, clear_cache
):
    gateway, _db_url = fresh("--mode", "exact", "--policy-version", "1")
    body = {**CHAT, "max_tokens": 1900, "min_tokens": 1900, "stream": True}
    preempted = preemptions(vllm)
    try:
        with httpx.stream(
            "POST", gateway.agent_url(rollout_id) + "/chat/completions", json=body, timeout=TIMEOUT
        ) as reply:
            lines = reply.iter_lines()
            first = next(lines)
            pause = {"mode": "keep", "clear_cache": clear_cache}
            admin(gateway, "/pause", json=pause).raise_for_status()
            before = time.time()
            admin(gateway, "/policy_version", json={"version": "2"}).raise_for_status()
            after = time.time()
            admin(gateway, "/resume").raise_for_status()
            rest = [line for line in lines if line]
    finally:
        admin(gateway, "/resume")
        admin(gateway, "/policy_version", json={"version": "default"})

    assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
    turn = stored_rollout(gateway, rollout_id)["turns"][0]
    assert turn["policy_version"] == "1"
    # The version at completion: "2" if the turn finished after the update, "1" if before.
    if turn["finished_at"] > after:
        assert (turn["policy_version_end"], turn["cache_kept"]) == ("2", not clear_cache)
    elif turn["finished_at"] < before:
        assert (turn["policy_version_end"], turn["cache_kept"]) == ("1", None)
    assert len(turn["completion_token_ids"]) == 1900
    # vLLM pauses after the first chunk, mid-reply: clearing its cache preempts the call to compute it again.
    assert preemptions(vllm) - preempted == (1 if clear_cache else 0)


def test_pause_timeout_answers_503_in_openai_format(fresh, rollout_id):
    gateway, _ = fresh("--pause-timeout", "0.5")
    admin(gateway, "/pause", json={"mode": "wait"})
    try:
        agent = sync_agent(gateway.agent_url(rollout_id))
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as raised:
            agent.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=3)
    finally:
        admin(gateway, "/resume")
    assert raised.value.status_code == 503
    assert raised.value.body["code"] == "paused"
    assert time.monotonic() - started >= 0.5  # it waited for the pause to end, then gave up


def test_admin_api_requires_the_token_when_one_is_set(fresh):
    gateway, _ = fresh("--admin-token", "s3cret")

    refused = admin(gateway, "/state")
    wrong = admin(gateway, "/state", headers={"authorization": "Bearer nope"})
    allowed = admin(gateway, "/state", headers={"authorization": "Bearer s3cret"})

    assert (refused.status_code, wrong.status_code, allowed.status_code) == (401, 401, 200)
    assert refused.json()["error"]["code"] == "unauthorized"
    state = allowed.json()
    assert state == {
        "epoch": state["epoch"],
        "paused": False,
        "pause_mode": None,
        "paused_by": None,
        "cache_kept": False,
        "in_flight": 0,
        "waiting": 0,
        "policy_version": "0",
        "adapters": [],
        "backends": state["backends"],
        "workers": [
            {
                "process_id": state["workers"][0]["process_id"],
                "host": socket.gethostname(),
                "pid": gateway.pid,
                "port": int(gateway.url.rpartition(":")[2]),
                "alive": True,
                "heartbeat_age": 0.0,
                "applied_epoch": state["epoch"],
                "in_flight": 0,
                "waiting": 0,
                "requests": 0,
            }
        ],
    }


def test_trainer_weight_sync_pauses_sets_the_version_and_resumes(fresh, rollout_id):
    from trainer_client import GatewayAdmin

    gateway, _db_url = fresh("--admin-token", "t")
    client = GatewayAdmin(gateway.url, admin_token="t")
    try:
        with client.weight_sync("9") as paused:
            assert paused["paused"] is True
            assert client.state()["policy_version"] == "0"
        state = client.state()
        httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=CHAT, timeout=TIMEOUT)
        with pytest.raises(RuntimeError, match="boom"), client.weight_sync("10"):
            raise RuntimeError("boom")
        after_failure = client.state()
    finally:
        client.set_policy_version("default")
        client.close()

    assert (state["paused"], state["policy_version"]) == (False, "9")
    assert (after_failure["paused"], after_failure["policy_version"]) == (False, "9")
    assert stored_rollout(gateway, rollout_id)["turns"][0]["policy_version"] == "9"


def test_pause_without_a_body_waits_for_calls_in_flight(inprocess, vllm):
    gateway = inprocess(backend=[vllm.url], backend_api_key=VLLM_KEY)

    paused = gateway.post("/admin/pause")
    resumed = gateway.post("/admin/resume")

    assert paused.status_code == 200, paused.text
    assert (paused.json()["paused"], resumed.json()["paused"]) == (True, False)
