"""Bad input and failing backends: OpenAI-format errors with the right status, error turns, no damage."""

from __future__ import annotations

import httpx
import openai
import pytest

from testbed.process import refusing_port

from support import TIMEOUT, VLLM_HEADERS, assert_openai_error, on_store, stored_rollout, sync_agent

pytestmark = on_store("postgresql")

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post_chat(gateway, rollout_id: str, **kwargs) -> httpx.Response:
    return httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", timeout=TIMEOUT, **kwargs)


@pytest.mark.parametrize(
    "fields",
    [{"stream": None}, {"n": None}, {"n": 1.0}, {"stream": "false"}, {"logprobs": None}, {"model": None}],
    ids=["stream-null", "n-null", "n-float", "stream-string", "logprobs-null", "model-null"],
)
def test_what_vllm_accepts_the_gateway_accepts(gateway, vllm, rollout_id, fields):
    body = {**CHAT, **fields}
    direct = httpx.post(vllm.url + "/v1/chat/completions", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)
    through = post_chat(gateway, rollout_id, json=body)

    assert (direct.status_code, through.status_code) == (200, 200)
    assert through.json()["object"] == direct.json()["object"] == "chat.completion"
    assert [t["status"] for t in stored_rollout(gateway, rollout_id)["turns"]] == ["ok"]


def test_a_string_true_streams_as_it_does_on_vllm(gateway, rollout_id):
    response = post_chat(gateway, rollout_id, json={**CHAT, "stream": "true"})

    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    assert stored_rollout(gateway, rollout_id)["turns"][0]["stream"] is True


@pytest.mark.parametrize(
    "fields",
    [{"top_logprobs": 2}, {"temperature": -1.0}, {"max_tokens": 0}, {"top_p": 5.0}],
    ids=["top_logprobs-without-logprobs", "negative-temperature", "zero-max-tokens", "top-p-above-one"],
)
def test_a_clients_mistake_gets_vllms_own_answer(gateway, vllm, rollout_id, fields):
    body = {**CHAT, **fields}
    direct = httpx.post(vllm.url + "/v1/chat/completions", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)
    through = post_chat(gateway, rollout_id, json=body)

    assert through.status_code == direct.status_code == 400
    assert through.json() == direct.json()
    assert through.headers["x-should-retry"] == "false"


def test_oversized_body_is_refused_with_413(gateway, rollout_id):
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * (33 * 1024 * 1024)}]}
    assert_openai_error(post_chat(gateway, rollout_id, json=huge), 413, "request_too_large")


def test_request_vllm_refuses_is_passed_on_and_stored_as_an_error_turn(gateway, vllm, rollout_id):
    body = {**CHAT, "max_tokens": 100_000}
    direct = httpx.post(vllm.url + "/v1/chat/completions", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)
    response = post_chat(gateway, rollout_id, json=body)

    assert response.status_code == direct.status_code == 400
    assert response.json() == direct.json()
    turn = stored_rollout(gateway, rollout_id)["turns"][0]
    assert turn["status"] == "error"
    assert turn["http_status"] == 400
    assert turn["error"] == response.json()["error"]["message"]
    assert turn["messages"] == CHAT["messages"]
    assert turn["completion_token_ids"] == []


def test_unreachable_backend_gives_503_and_an_error_turn(start_gateway, databases, db_kind, rollout_id):
    db_url = databases.new(db_kind)
    dead = start_gateway(db_url, backends=[f"http://127.0.0.1:{refusing_port()}"])
    client = sync_agent(dead.agent_url(rollout_id))

    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(**CHAT)

    assert raised.value.status_code == 503
    assert raised.value.body["code"] == "backend_unavailable"
    turn = stored_rollout(dead, rollout_id)["turns"][0]
    assert (turn["status"], turn["http_status"]) == ("error", 503)
    assert "no backend reachable" in turn["error"]
    stream = httpx.post(
        dead.agent_url(rollout_id) + "/chat/completions", json={**CHAT, "stream": True}, timeout=TIMEOUT
    )
    assert_openai_error(stream, 503, "backend_unavailable")
    assert [t["status"] for t in stored_rollout(dead, rollout_id)["turns"]] == ["error", "error"]


def test_second_backend_serves_when_the_first_is_down(start_gateway, databases, db_kind, vllm, rollout_id):
    db_url = databases.new(db_kind)
    pair = start_gateway(db_url, backends=[f"http://127.0.0.1:{refusing_port()}", vllm.url])
    client = sync_agent(pair.agent_url(rollout_id))
    for _ in range(2):
        client.chat.completions.create(**CHAT)
    turns = stored_rollout(pair, rollout_id)["turns"]
    assert [(t["status"], t["backend"]) for t in turns] == [("ok", vllm.url), ("ok", vllm.url)]


def test_unregistered_rollouts_are_404_when_registration_is_required(
    start_gateway, databases, db_kind, rollout_id
):
    db_url = databases.new(db_kind)
    strict = start_gateway(db_url, "--require-registered-rollouts")

    assert_openai_error(post_chat(strict, rollout_id, json=CHAT), 404, "rollout_not_found")
    created = httpx.post(strict.url + "/rollouts", json={"rollout_id": rollout_id}, timeout=TIMEOUT)
    assert created.status_code == 201
    assert post_chat(strict, rollout_id, json=CHAT).status_code == 200


def test_calls_on_a_finished_rollout_are_409_and_leave_it_intact(gateway, db_url, rollout_id):
    assert post_chat(gateway, rollout_id, json=CHAT).status_code == 200
    assert (
        httpx.post(
            f"{gateway.url}/rollouts/{rollout_id}/finish", json={"reward": 1.0}, timeout=TIMEOUT
        ).status_code
        == 200
    )

    refused = post_chat(gateway, rollout_id, json=CHAT)
    assert_openai_error(refused, 409, "rollout_finished")
    assert refused.headers["x-should-retry"] == "false"  # the SDKs retry a 409 otherwise
    rollout = stored_rollout(gateway, rollout_id)
    assert (rollout["status"], rollout["reward"], len(rollout["turns"])) == ("completed", 1.0, 1)
