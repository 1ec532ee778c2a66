"""Control API: rollouts in GRPO groups, rewards, finish, inspection, health and metrics."""

from __future__ import annotations

import httpx
import pytest

from support import TIMEOUT, stored_rollout, sync_agent

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "min_tokens": 3}


def test_create_rollout_returns_the_agent_base_url(gateway):
    response = httpx.post(
        gateway.url + "/rollouts",
        json={"group_id": "g-1", "task_id": "t-9", "metadata": {"k": [1]}},
        timeout=TIMEOUT,
    )

    assert response.status_code == 201
    body = response.json()
    assert len(body["rollout_id"]) == 32
    assert body["group_id"] == "g-1"
    assert body["task_id"] == "t-9"
    assert body["metadata"] == {"k": [1]}
    assert body["status"] == "running"
    assert body["base_url"] == f"{gateway.url}/rollouts/{body['rollout_id']}/v1"


def test_rollout_creation_is_idempotent_on_its_id(gateway, rollout_id):
    first = httpx.post(
        gateway.url + "/rollouts", json={"rollout_id": rollout_id, "group_id": "g"}, timeout=TIMEOUT
    )
    again = httpx.post(
        gateway.url + "/rollouts", json={"rollout_id": rollout_id, "group_id": "g"}, timeout=TIMEOUT
    )
    other = httpx.post(
        gateway.url + "/rollouts", json={"rollout_id": rollout_id, "group_id": "h"}, timeout=TIMEOUT
    )

    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 409)
    assert first.json()["created"] is True and again.json()["created"] is False
    assert other.json()["error"]["code"] == "rollout_conflict"


def test_base_url_works_with_an_unmodified_openai_client(gateway, db_url):
    created = httpx.post(gateway.url + "/rollouts", json={"group_id": "g-sdk"}, timeout=TIMEOUT).json()
    agent = sync_agent(created["base_url"])
    agent.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=3)

    rollout = stored_rollout(gateway, created["rollout_id"])
    assert (rollout["group_id"], len(rollout["turns"])) == ("g-sdk", 1)


def test_rewards_and_finish_are_recorded(gateway, db_url, rollout_id):
    httpx.post(gateway.url + "/rollouts", json={"rollout_id": rollout_id, "group_id": "g-r"}, timeout=TIMEOUT)
    httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=CHAT, timeout=TIMEOUT)

    turn_reward = httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/reward", json={"reward": 0.25, "turn_index": 0}, timeout=TIMEOUT
    )
    rollout_reward = httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/reward",
        json={"reward": 0.5, "components": {"format": 0.5}},
        timeout=TIMEOUT,
    )
    finish = httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/finish",
        json={"status": "truncated", "reward": 0.75},
        timeout=TIMEOUT,
    )
    second_finish = httpx.post(f"{gateway.url}/rollouts/{rollout_id}/finish", json={}, timeout=TIMEOUT)

    assert (turn_reward.status_code, rollout_reward.status_code, finish.status_code) == (200, 200, 200)
    assert second_finish.status_code == 409
    assert second_finish.json()["error"]["code"] == "rollout_finished"
    assert finish.json()["status"] == "truncated"
    rollout = stored_rollout(gateway, rollout_id)
    assert rollout["status"] == "truncated"
    assert rollout["reward"] == 0.75
    assert [(r["turn_index"], r["value"], r["components"]) for r in rollout["rewards"]] == [
        (0, 0.25, None),
        (None, 0.5, {"format": 0.5}),
        (None, 0.75, None),
    ]
    assert rollout["finished_at"] >= rollout["created_at"]


@pytest.mark.parametrize(
    "content",
    [
        b'{"reward": NaN}',
        b'{"reward": Infinity}',
        b'{"reward": 1e999}',
        b'{"reward": "1.0"}',
        b'{"reward": 1.0, "components": {"a": NaN}}',
        b'{"reward": 1.0, "turn_index": -1}',
        b'{"reward": 1.0, "unknown": 1}',
        b"{}",
    ],
)
def test_invalid_rewards_are_refused_without_touching_the_rollout(gateway, db_url, rollout_id, content):
    httpx.post(gateway.url + "/rollouts", json={"rollout_id": rollout_id}, timeout=TIMEOUT)

    response = httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/reward",
        content=content,
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )

    assert response.status_code in (400, 422)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    rollout = stored_rollout(gateway, rollout_id)
    assert (rollout["reward"], rollout["rewards"]) == (None, [])


def test_reward_for_unknown_rollout_or_turn_is_404(gateway, rollout_id):
    assert (
        httpx.post(
            f"{gateway.url}/rollouts/{rollout_id}/reward", json={"reward": 1.0}, timeout=TIMEOUT
        ).status_code
        == 404
    )
    httpx.post(gateway.url + "/rollouts", json={"rollout_id": rollout_id}, timeout=TIMEOUT)
    missing_turn = httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/reward", json={"reward": 1.0, "turn_index": 3}, timeout=TIMEOUT
    )
    assert missing_turn.status_code == 404
    assert missing_turn.json()["error"]["code"] == "turn_not_found"


def test_finish_rejects_unknown_status_and_components_without_reward(gateway, db_url, rollout_id):
    httpx.post(gateway.url + "/rollouts", json={"rollout_id": rollout_id}, timeout=TIMEOUT)

    unknown = httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/finish", json={"status": "done"}, timeout=TIMEOUT
    )
    orphan = httpx.post(
        f"{gateway.url}/rollouts/{rollout_id}/finish", json={"components": {"a": 1.0}}, timeout=TIMEOUT
    )

    assert unknown.status_code == orphan.status_code == 422
    assert unknown.json()["error"]["param"] == "status"
    assert "give the reward too" in orphan.json()["error"]["message"]
    assert stored_rollout(gateway, rollout_id)["status"] == "running"


def test_get_rollout_shows_turns_and_tokens_only_on_request(gateway, rollout_id):
    httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=CHAT, timeout=TIMEOUT)

    plain = httpx.get(f"{gateway.url}/rollouts/{rollout_id}", timeout=TIMEOUT).json()
    full = httpx.get(
        f"{gateway.url}/rollouts/{rollout_id}", params={"include_tokens": "true"}, timeout=TIMEOUT
    ).json()

    assert {"rollout_id", "group_id", "status", "reward", "turns"} <= set(plain)
    assert "prompt_token_ids" not in plain["turns"][0]
    turn = full["turns"][0]
    for field in (
        "index",
        "status",
        "finish_reason",
        "prompt_token_ids",
        "completion_token_ids",
        "completion_logprobs",
        "policy_version",
    ):
        assert field in turn
    assert len(turn["completion_token_ids"]) == len(turn["completion_logprobs"]) == 3
    assert httpx.get(f"{gateway.url}/rollouts/nope-{rollout_id}", timeout=TIMEOUT).status_code == 404


def test_health_and_prometheus_metrics(gateway, rollout_id):
    httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=CHAT, timeout=TIMEOUT)

    health = httpx.get(gateway.url + "/healthz", timeout=TIMEOUT).json()
    metrics = httpx.get(gateway.url + "/metrics", timeout=TIMEOUT).text

    assert health["status"] == "ok"
    for name in (
        'gateway_requests_total{endpoint="chat",status="200"}',
        "gateway_request_latency_seconds_bucket",
        'gateway_tokens_total{kind="completion"}',
        "gateway_errors_total",
        "gateway_calls_in_flight",
        "gateway_store_commits_total",
    ):
        assert name in metrics, name
