"""Trust boundaries: the control token, per-rollout agent keys, the admin token, the gateway's own backend
key.

An agent holds only its rollout's key: it can call the model for that rollout and nothing else.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import httpx
import pytest

from gateway.app import warn_if_exposed
from gateway.settings import Settings

from support import TIMEOUT, VLLM_KEY, client_of, stored_rollout, sync_agent

CONTROL, ADMIN = "control-secret", "admin-secret"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def assert_unauthorized(response, code: str = "unauthorized") -> None:
    assert response.status_code == 401, response.text
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": code,
        }
    }
    assert response.headers["x-should-retry"] == "false"


@pytest.fixture
def keyed(inprocess, vllm):
    """A gateway in this process with a control token, an admin token and rollout keys, on the session's
    vLLM."""
    return inprocess(
        backend=[vllm.url],
        backend_api_key=VLLM_KEY,
        control_token=CONTROL,
        admin_token=ADMIN,
        rollout_keys=True,
    )


@pytest.fixture
def keyed_process(start_gateway, databases, db_kind):
    """The same gateway as a process of its own, for real clients and its real log."""
    flags = ("--control-token", CONTROL, "--admin-token", ADMIN, "--rollout-keys", "--log-level", "debug")
    return start_gateway(databases.new(db_kind), *flags, process=True)


def create(gateway, **body) -> dict:
    response = client_of(gateway).post(gateway.url + "/rollouts", json=body, headers=bearer(CONTROL))
    assert response.status_code == 201, response.text
    return response.json()


def test_control_api_needs_the_control_token(inprocess, rollout_id):
    gateway = inprocess(control_token=CONTROL)
    calls = [
        ("POST", "/rollouts", {"rollout_id": rollout_id}),
        ("POST", f"/rollouts/{rollout_id}/reward", {"reward": 1.0}),
        ("POST", f"/rollouts/{rollout_id}/finish", {}),
        ("GET", f"/rollouts/{rollout_id}", None),
    ]
    for method, path, body in calls:
        assert_unauthorized(gateway.request(method, path, json=body))
        assert_unauthorized(gateway.request(method, path, json=body, headers=bearer("wrong")))
        assert_unauthorized(gateway.request(method, path, json=body, headers={"authorization": CONTROL}))

    assert (
        gateway.post("/rollouts", json={"rollout_id": rollout_id}, headers=bearer(CONTROL)).status_code == 201
    )
    assert (
        gateway.post(
            f"/rollouts/{rollout_id}/reward", json={"reward": 1.0}, headers=bearer(CONTROL)
        ).status_code
        == 200
    )
    assert gateway.post(f"/rollouts/{rollout_id}/finish", headers=bearer(CONTROL)).status_code == 200
    assert stored_rollout(gateway, rollout_id, CONTROL)["status"] == "completed"
    assert gateway.get("/healthz").status_code == 200  # health and metrics stay open
    assert gateway.get("/metrics").status_code == 200


def test_rollout_keys_are_answered_once_and_stored_only_as_hashes(keyed, rollout_id):
    created = create(keyed, rollout_id=rollout_id)
    again = keyed.post("/rollouts", json={"rollout_id": rollout_id}, headers=bearer(CONTROL))

    assert created["api_key"].startswith("rk-") and len(created["api_key"]) > 40
    assert (again.status_code, again.json()["api_key"]) == (200, None)
    assert created["api_key"] not in keyed.get(f"/rollouts/{rollout_id}", headers=bearer(CONTROL)).text
    assert create(keyed)["api_key"] != created["api_key"]


def test_agent_with_its_key_calls_the_model_through_the_openai_sdk(keyed_process):
    created = create(keyed_process, group_id="g")
    agent = sync_agent(created["base_url"], api_key=created["api_key"])

    reply = agent.chat.completions.create(**CHAT)

    turns = stored_rollout(keyed_process, created["rollout_id"], CONTROL)["turns"]
    # An empty reply (the tiny model can sample its end token first) is stored as null content.
    assert [(t["status"], t["content"]) for t in turns] == [("ok", reply.choices[0].message.content or None)]


def test_agent_holding_its_own_key_cannot_reward_finish_read_or_administer(keyed):
    mine, other = create(keyed), create(keyed)
    key = bearer(mine["api_key"])

    assert_unauthorized(
        keyed.post(f"/rollouts/{mine['rollout_id']}/reward", json={"reward": 1.0}, headers=key)
    )
    assert_unauthorized(
        keyed.post(f"/rollouts/{mine['rollout_id']}/finish", json={"reward": 1.0}, headers=key)
    )
    assert_unauthorized(keyed.get(f"/rollouts/{mine['rollout_id']}", headers=key))
    assert_unauthorized(keyed.get(f"/rollouts/{other['rollout_id']}", headers=key))
    assert_unauthorized(keyed.post("/rollouts", json={}, headers=key))
    assert_unauthorized(keyed.get("/admin/state", headers=key))
    assert_unauthorized(keyed.post("/admin/pause", headers=key))
    assert_unauthorized(keyed.post("/admin/policy_version", json={"version": "9"}, headers=key))

    rollout = stored_rollout(keyed, mine["rollout_id"], CONTROL)
    assert (rollout["status"], rollout["reward"], rollout["rewards"]) == ("running", None, [])
    assert keyed.get("/admin/state", headers=bearer(ADMIN)).json()["policy_version"] == "0"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer "},
        {"authorization": "Basic abc"},
        bearer(CONTROL),
        bearer(ADMIN),
        bearer(VLLM_KEY),
        {"x-api-key": "rk-guess"},
        "another rollout's key",
    ],
    ids=["none", "empty", "basic", "control", "admin", "backend", "x-api-key", "other-rollout"],
)
def test_agent_calls_without_their_rollouts_key_are_401_and_reach_nothing(keyed, headers):
    mine, other = create(keyed), create(keyed)
    if headers == "another rollout's key":
        headers = bearer(other["api_key"])

    chat = keyed.post(f"/rollouts/{mine['rollout_id']}/v1/chat/completions", json=CHAT, headers=headers)
    completion = keyed.post(
        f"/rollouts/{mine['rollout_id']}/v1/completions",
        json={"model": "tiny", "prompt": "hi"},
        headers=headers,
    )
    models = keyed.get(f"/rollouts/{mine['rollout_id']}/v1/models", headers=headers)

    for response in (chat, completion, models):
        assert_unauthorized(response, "invalid_api_key")
    assert stored_rollout(keyed, mine["rollout_id"], CONTROL)["turns"] == []


def test_a_key_opens_no_rollout_that_does_not_exist(keyed, rollout_id):
    mine = create(keyed)
    response = keyed.post(
        f"/rollouts/{rollout_id}/v1/chat/completions", json=CHAT, headers=bearer(mine["api_key"])
    )

    assert_unauthorized(response, "invalid_api_key")
    assert keyed.get(f"/rollouts/{rollout_id}", headers=bearer(CONTROL)).status_code == 404


def test_admin_api_takes_the_control_token_unless_it_has_its_own(inprocess):
    shared = inprocess(control_token=CONTROL)
    separate = inprocess(control_token=CONTROL, admin_token=ADMIN)

    assert shared.get("/admin/state", headers=bearer(CONTROL)).status_code == 200
    assert_unauthorized(shared.get("/admin/state"))
    assert separate.get("/admin/state", headers=bearer(ADMIN)).status_code == 200
    assert_unauthorized(separate.get("/admin/state", headers=bearer(CONTROL)))


def test_secrets_stay_out_of_stored_turns_metrics_and_logs(keyed_process):
    gateway = keyed_process
    created = create(gateway)
    agent = sync_agent(created["base_url"], api_key=created["api_key"])
    agent.chat.completions.create(**CHAT)
    httpx.post(
        f"{created['base_url']}/chat/completions", json=CHAT, headers=bearer("rk-wrong"), timeout=TIMEOUT
    )

    stored = httpx.get(
        f"{gateway.url}/rollouts/{created['rollout_id']}",
        params={"include_messages": "true"},
        headers=bearer(CONTROL),
        timeout=TIMEOUT,
    ).text
    metrics = httpx.get(gateway.url + "/metrics", timeout=TIMEOUT).text
    log = gateway.log_path.read_text()
    settings = repr(Settings(control_token=CONTROL, admin_token=ADMIN, backend_api_key=VLLM_KEY))
    assert "DEBUG" in log and created["rollout_id"] in stored
    for secret in (created["api_key"], CONTROL, ADMIN, VLLM_KEY, "rk-wrong"):
        assert secret not in stored
        assert secret not in metrics
        assert secret not in log
        assert secret not in settings


def test_gateway_calls_its_backends_with_its_own_key_never_the_agents(inprocess, vllm, rollout_id):
    without_key = inprocess(backend=[vllm.url])
    with_key = inprocess(backend=[vllm.url], backend_api_key=VLLM_KEY)
    agent_auth = bearer("the-agents-own-key")  # vLLM would refuse it if it were forwarded

    refused = without_key.post(
        f"/rollouts/{rollout_id}/v1/chat/completions", json=CHAT, headers=bearer(VLLM_KEY)
    )
    served = with_key.post(f"/rollouts/{rollout_id}/v1/chat/completions", json=CHAT, headers=agent_auth)

    assert refused.status_code == 502
    assert refused.json()["error"]["code"] == "backend_error"
    assert "--backend-api-key" in refused.json()["error"]["message"]
    assert served.status_code == 200
    assert [t["status"] for t in stored_rollout(with_key, rollout_id)["turns"]] == ["ok"]


@pytest.mark.engine  # starts `gateway serve` as a process
@pytest.mark.parametrize("flag", ["--control-token", "--admin-token", "--backend-api-key"])
def test_an_empty_token_is_refused_at_start_up(flag):
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", flag, " "], capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gateway serve: error: {flag}: an empty token would let anyone in: "
        "give a real token or leave the option out"
    ]


def test_serving_beyond_loopback_without_tokens_warns(caplog):
    with caplog.at_level(logging.WARNING):
        warn_if_exposed(Settings(host="0.0.0.0"))
        exposed = caplog.text
        caplog.clear()
        warn_if_exposed(Settings(host="0.0.0.0", control_token=CONTROL, rollout_keys=True))

    assert "without --control-token" in exposed and "without --rollout-keys" in exposed
    assert caplog.text == ""
