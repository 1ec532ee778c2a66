"""Per-rollout limits (max_turns, max_context_tokens) and prompts longer than the engine's context: a clean
OpenAI-format 400 that the SDKs do not retry, a refused turn, and the rollout's summary saying why it
ended."""

from __future__ import annotations

import httpx
import openai
import pytest

from support import VLLM_KEY, client_of, stored_rollout, sync_agent, tokenize_chat

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3}
LONG = [{"role": "user", "content": "word " * 70_000}]  # about 70,000 tokens: more than the engine's 65,536


@pytest.fixture
def gateway_on_vllm(inprocess, vllm):
    def start(**settings):
        return inprocess(backend=[vllm.url], backend_api_key=VLLM_KEY, **settings)

    return start


def create(gateway, **body) -> dict:
    response = client_of(gateway).post(gateway.url + "/rollouts", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def chat(gateway, rollout_id: str, body: dict) -> httpx.Response:
    return client_of(gateway).post(f"{gateway.url}/rollouts/{rollout_id}/v1/chat/completions", json=body)


def assert_refused(response, code: str) -> dict:
    assert response.status_code == 400, response.text
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (code, error["type"])
    return error


def test_a_call_past_max_turns_is_refused_recorded_and_ends_the_rollout(gateway_on_vllm):
    gateway = gateway_on_vllm()
    rollout = create(gateway, limits={"max_turns": 2})

    answered = [chat(gateway, rollout["rollout_id"], CHAT).status_code for _ in range(2)]
    refused = chat(gateway, rollout["rollout_id"], CHAT)

    assert answered == [200, 200]
    error = assert_refused(refused, "rollout_turn_limit")
    assert error["message"] == f"rollout {rollout['rollout_id']!r} reached its limit of 2 model calls"
    stored = stored_rollout(gateway, rollout["rollout_id"])
    assert (stored["limits"], stored["end_reason"]) == (
        {"max_turns": 2, "max_context_tokens": None},
        "max_turns",
    )
    assert [(t["status"], t["http_status"]) for t in stored["turns"]] == [
        ("ok", 200),
        ("ok", 200),
        ("refused", 400),
    ]
    assert stored["turns"][2]["error"] == error["message"]
    assert stored["turns"][2]["completion_token_ids"] == []


def test_the_openai_sdk_stops_at_the_limit_without_retrying(start_gateway, databases, db_kind):
    gateway = start_gateway(databases.new(db_kind), "--max-turns", "1")
    rollout = create(gateway)
    agent = sync_agent(rollout["base_url"], max_retries=3)

    agent.chat.completions.create(**CHAT)
    with pytest.raises(openai.BadRequestError) as raised:
        agent.chat.completions.create(**CHAT)

    assert raised.value.code == "rollout_turn_limit"
    assert [t["status"] for t in stored_rollout(gateway, rollout["rollout_id"])["turns"]] == ["ok", "refused"]


def test_gateway_default_limits_apply_to_rollouts_without_their_own(gateway_on_vllm, rollout_id):
    gateway = gateway_on_vllm(max_turns=1)
    own = create(gateway, limits={"max_turns": 2})

    assert [chat(gateway, rollout_id, CHAT).status_code for _ in range(2)] == [200, 400]
    assert [chat(gateway, own["rollout_id"], CHAT).status_code for _ in range(3)] == [200, 200, 400]
    assert stored_rollout(gateway, rollout_id)["end_reason"] == "max_turns"


@pytest.mark.parametrize("mode", ["passthrough", "exact"])
def test_a_prompt_past_max_context_tokens_is_refused_with_its_ids(gateway_on_vllm, vllm, mode):
    gateway = gateway_on_vllm()
    rollout = create(gateway, mode=mode, limits={"max_context_tokens": 8})
    prompt = tokenize_chat(vllm, MESSAGES)

    error = assert_refused(chat(gateway, rollout["rollout_id"], CHAT), "context_length_exceeded")

    assert error["message"] == (
        "this model's maximum context length is 8 tokens for this rollout; "
        f"the prompt has {len(prompt)} tokens"
    )
    stored = stored_rollout(gateway, rollout["rollout_id"])
    assert stored["end_reason"] == "max_context_tokens"
    assert [(t["status"], t["prompt_token_ids"]) for t in stored["turns"]] == [("refused", prompt)]


@pytest.mark.parametrize("mode", ["passthrough", "exact"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_is_cut_to_fit_max_context_tokens(gateway_on_vllm, vllm, mode, stream):
    gateway = gateway_on_vllm()
    prompt = tokenize_chat(vllm, MESSAGES)
    rollout = create(gateway, mode=mode, limits={"max_context_tokens": len(prompt) + 5})
    body = {**CHAT, "max_tokens": 50, "ignore_eos": True, "stream": stream}

    response = chat(gateway, rollout["rollout_id"], body)

    assert response.status_code == 200, response.text
    turn = stored_rollout(gateway, rollout["rollout_id"])["turns"][0]
    assert (turn["status"], turn["finish_reason"], len(turn["completion_token_ids"])) == ("ok", "length", 5)
    assert turn["prompt_token_ids"] == prompt
    assert turn["params"]["max_tokens"] == 50  # stored as the agent asked


def test_completions_prompt_ids_count_against_max_context_tokens(gateway_on_vllm):
    gateway = gateway_on_vllm(max_context_tokens=4)
    rollout = create(gateway)
    url = f"{gateway.url}/rollouts/{rollout['rollout_id']}/v1/completions"

    fits = gateway.post(url, json={"model": "tiny", "prompt": [1, 2], "max_tokens": 10, "ignore_eos": True})
    refused = gateway.post(url, json={"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 1})

    assert fits.status_code == 200
    assert_refused(refused, "context_length_exceeded")
    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    assert [(t["status"], len(t["completion_token_ids"])) for t in turns] == [("ok", 2), ("refused", 0)]


@pytest.mark.parametrize("mode", ["passthrough", "exact"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_engines_context_is_a_clean_400(gateway_on_vllm, mode, stream):
    gateway = gateway_on_vllm()
    rollout = create(gateway, mode=mode)

    response = chat(gateway, rollout["rollout_id"], {**CHAT, "messages": LONG, "stream": stream})

    error = assert_refused(response, "context_length_exceeded")
    assert "maximum context length" in error["message"] or "maximum model length" in error["message"]
    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    assert [(t["status"], t["http_status"]) for t in turns] == [("error", 400)]
