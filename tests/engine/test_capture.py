"""Every model call through the gateway is stored with the engine's exact tokens; agents see vLLM's reply."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson

from support import TIMEOUT, VLLM_HEADERS, coalesced, detokenize, stored_rollout, sync_agent, tokenize_chat

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three prime numbers, é and ü included."},
]
SAMPLING: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0.0, "seed": 7}


def client(gateway, rollout_id: str) -> openai.OpenAI:
    return sync_agent(gateway.agent_url(rollout_id))


def direct_and_through(gateway, vllm, rollout_id: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The whole reply vLLM gives `body` directly, and the one the agent gets through the gateway."""
    direct = httpx.post(vllm.url + "/v1/chat/completions", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT)
    through = httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=body, timeout=TIMEOUT)
    return direct.json(), through.json()


def without_ids(payload: dict[str, Any]) -> dict[str, Any]:
    """A reply minus what differs between two identical requests (its id and creation time)."""
    return {k: v for k, v in payload.items() if k not in ("id", "created")}


def test_chat_turn_stores_the_prompt_ids_vllm_renders_and_the_sampled_ids(gateway, vllm, db_url, rollout_id):
    reply = client(gateway, rollout_id).chat.completions.create(messages=MESSAGES, **SAMPLING)

    turn = stored_rollout(gateway, rollout_id)["turns"][0]
    assert turn["status"] == "ok"
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, MESSAGES)
    assert turn["prompt_tokens"] == len(turn["prompt_token_ids"]) == reply.usage.prompt_tokens
    assert len(turn["completion_token_ids"]) == reply.usage.completion_tokens == 12
    assert detokenize(vllm, turn["completion_token_ids"]) == reply.choices[0].message.content
    assert turn["content"] == reply.choices[0].message.content
    assert len(turn["completion_logprobs"]) == 12
    assert all(lp <= 0.0 for lp in turn["completion_logprobs"])
    assert turn["finish_reason"] == "length"
    assert turn["messages"] == MESSAGES
    assert turn["policy_version"] == "0"
    assert turn["params"] == {"model": "tiny", "max_tokens": 12, "temperature": 0.0, "seed": 7}


def test_nul_characters_in_a_turn_are_stored_and_lose_nothing(gateway, vllm, db_url, db_kind, rollout_id):
    messages = [{"role": "user", "content": "before\x00after"}]

    reply = client(gateway, rollout_id).chat.completions.create(messages=messages, **SAMPLING)

    turn = stored_rollout(gateway, rollout_id)["turns"][0]
    nul = "\x00" if db_kind == "sqlite" else "\ufffd"  # PostgreSQL text and JSONB cannot hold NUL
    assert turn["status"] == "ok"
    assert turn["content"] == reply.choices[0].message.content.replace("\x00", nul)
    assert turn["messages"] == [{"role": "user", "content": f"before{nul}after"}]
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, messages)  # the ids are exact everywhere


def test_agent_receives_exactly_the_reply_vllm_sends_for_its_own_request(gateway, vllm, rollout_id):
    body = {"messages": MESSAGES, **SAMPLING}
    direct, through = direct_and_through(gateway, vllm, rollout_id, body)

    assert without_ids(through) == without_ids(direct)
    assert through["prompt_token_ids"] is None
    assert through["choices"][0]["token_ids"] is None
    assert through["choices"][0]["logprobs"] is None


def test_agent_that_asks_for_token_ids_and_logprobs_gets_them(gateway, vllm, rollout_id):
    body = {"messages": MESSAGES, **SAMPLING, "return_token_ids": True, "logprobs": True}
    direct, through = direct_and_through(gateway, vllm, rollout_id, body)

    assert without_ids(through) == without_ids(direct)
    assert through["prompt_token_ids"] == tokenize_chat(vllm, MESSAGES)


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


def test_streamed_reply_equals_vllm_stream_chunk_for_chunk(gateway, vllm, rollout_id):
    body = {"messages": MESSAGES, **SAMPLING, "stream": True}
    direct = sse_events(
        httpx.post(
            vllm.url + "/v1/chat/completions", json=body, headers=VLLM_HEADERS, timeout=TIMEOUT
        ).content
    )
    through = sse_events(
        httpx.post(gateway.agent_url(rollout_id) + "/chat/completions", json=body, timeout=TIMEOUT).content
    )

    assert through[-1] == direct[-1] == "[DONE]"
    assert coalesced([without_ids(c) for c in through[:-1]]) == coalesced(
        [without_ids(c) for c in direct[:-1]]
    )


def test_streaming_and_non_streaming_store_the_same_fields(gateway, db_url, rollout_id):
    agent = client(gateway, rollout_id)
    whole = agent.chat.completions.create(messages=MESSAGES, **SAMPLING)
    pieces = agent.chat.completions.create(
        messages=MESSAGES, **SAMPLING, stream=True, stream_options={"include_usage": True}
    )
    streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)

    first, second = stored_rollout(gateway, rollout_id)["turns"]
    assert (first["stream"], second["stream"]) == (False, True)
    assert streamed_text == whole.choices[0].message.content
    for field in (
        "status",
        "content",
        "finish_reason",
        "prompt_token_ids",
        "completion_token_ids",
        "prompt_tokens",
        "completion_tokens",
        "messages",
        "tool_calls",
        "reasoning",
        "policy_version",
    ):
        assert first[field] == second[field], field
    assert [round(x, 4) for x in first["completion_logprobs"]] == [
        round(x, 4) for x in second["completion_logprobs"]
    ]
    assert second["first_token_at"] <= second["finished_at"]


def test_completions_endpoint_with_token_id_prompt_is_captured(gateway, vllm, db_url, rollout_id):
    prompt_ids = tokenize_chat(vllm, MESSAGES)
    reply = client(gateway, rollout_id).completions.create(prompt=prompt_ids, **SAMPLING)

    turn = stored_rollout(gateway, rollout_id)["turns"][0]
    assert turn["endpoint"] == "completions"
    assert turn["prompt_token_ids"] == prompt_ids
    assert detokenize(vllm, turn["completion_token_ids"]) == reply.choices[0].text
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"]) == 12
    assert reply.choices[0].logprobs is None


def test_streamed_completions_are_captured_like_whole_ones(gateway, db_url, rollout_id):
    agent = client(gateway, rollout_id)
    whole = agent.completions.create(prompt="Once upon a time", **SAMPLING)
    text = "".join(
        chunk.choices[0].text
        for chunk in agent.completions.create(prompt="Once upon a time", **SAMPLING, stream=True)
        if chunk.choices
    )

    first, second = stored_rollout(gateway, rollout_id)["turns"]
    assert text == whole.choices[0].text == first["content"] == second["content"]
    assert first["prompt_token_ids"] == second["prompt_token_ids"]
    assert first["completion_token_ids"] == second["completion_token_ids"]
    assert first["prompt_text"] == "Once upon a time"


def test_models_lists_the_served_model(gateway, rollout_id):
    models = client(gateway, rollout_id).models.list()
    assert [m.id for m in models.data] == ["tiny"]
