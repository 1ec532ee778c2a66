"""The Anthropic Messages dialect in process: the `anthropic` SDK against `create_app` and a scripted engine.
Requests become chat requests for the engine; its chat replies, whole or streamed, come back as Messages."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import orjson
import pytest

from support import assert_openai_error
from support.fake_engine import chat_reply, chat_stream, json_reply

pytestmark = pytest.mark.anyio

PROMPT = [1, 10, 11, 2]
TOOL = {"name": "ls", "description": "List a directory.", "input_schema": {"type": "object"}}
CALL = {
    "id": "chatcmpl-tool-1",
    "type": "function",
    "function": {"name": "ls", "arguments": '{"path": "/tmp"}'},
}


def agent(gw: Any, rollout_id: str = "r1") -> anthropic.AsyncAnthropic:
    """The SDK on its own HTTP library (httpx2), reaching the app in process."""
    client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), base_url="http://gateway")
    return anthropic.AsyncAnthropic(
        api_key="unused", base_url=f"http://gateway/rollouts/{rollout_id}", http_client=client, max_retries=0
    )


def sent(gw: Any) -> dict[str, Any]:
    """The chat request the engine received last."""
    return gw.engine.requests[-1][1]


async def test_a_whole_reply_is_a_message_and_the_turn_keeps_the_engines_ids(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 6, 2], "Hello."))

    reply = await agent(gw).messages.create(
        model="tiny",
        max_tokens=64,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
        stop_sequences=["END"],
        extra_body={"temperature": 0.5},
    )

    assert [(b.type, b.text) for b in reply.content] == [("text", "Hello.")]
    assert (reply.stop_reason, reply.role, reply.usage.input_tokens, reply.usage.output_tokens) == (
        "end_turn",
        "assistant",
        4,
        3,
    )
    request = sent(gw)
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (request["max_tokens"], request["temperature"], request["stop"]) == (64, 0.5, ["END"])
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["prompt_token_ids"], turn["completion_token_ids"], turn["content"]) == (
        PROMPT,
        [5, 6, 2],
        "Hello.",
    )
    assert turn["endpoint"] == "messages"


async def test_a_tool_call_is_a_tool_use_block_and_its_result_goes_back_as_a_tool_message(gw):
    gw.engine.answer(
        "/v1/chat/completions",
        chat_reply(PROMPT, [40, 41, 2], "", finish_reason="tool_calls", tool_calls=[CALL]),
    )
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [7, 2], "a.txt is there."))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in /tmp?"}]

    first = await agent(gw).messages.create(model="tiny", max_tokens=64, messages=messages, tools=[TOOL])
    (use,) = first.content
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "a.txt"},
                {"type": "text", "text": "Go on."},
            ],
        },
    ]
    await agent(gw).messages.create(model="tiny", max_tokens=64, messages=messages, tools=[TOOL])

    assert (first.stop_reason, use.type, use.id, use.name, use.input) == (
        "tool_use",
        "tool_use",
        "chatcmpl-tool-1",
        "ls",
        {"path": "/tmp"},
    )
    assert sent(gw)["tools"] == [
        {
            "type": "function",
            "function": {"name": "ls", "parameters": {"type": "object"}, "description": "List a directory."},
        }
    ]
    assert sent(gw)["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**CALL, "function": {"name": "ls", "arguments": '{"path":"/tmp"}'}}],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "a.txt"},
        {"role": "user", "content": "Go on."},
    ]
    turns = (await gw.rollout("r1"))["turns"]
    assert [t["parent_turn"] for t in turns] == [None, 0]


async def test_a_streamed_reply_is_the_messages_event_sequence(gw):
    gw.engine.answer("/v1/chat/completions", chat_stream(PROMPT, [(5, "Hel"), (6, "lo.")]))

    async with agent(gw).messages.stream(
        model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        events = [event.type async for event in stream]
        final = await stream.get_final_message()

    assert events[0] == "message_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [(b.type, b.text) for b in final.content] == [("text", "Hello.")]
    assert final.stop_reason == "end_turn"
    assert sent(gw)["stream_options"] == {"include_usage": True}
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["completion_token_ids"], turn["content"], turn["stream"]) == ([5, 6], "Hello.", True)


async def test_a_stop_sequence_is_reported_as_such(gw):
    reply = orjson.loads(await chat_reply(PROMPT, [5, 2], "Hi").body())
    reply["choices"][0]["stop_reason"] = "END"
    gw.engine.answer("/v1/chat/completions", json_reply(reply))

    message = await agent(gw).messages.create(
        model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Hi"}], stop_sequences=["END"]
    )

    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")


async def test_an_image_is_refused_with_a_clear_400_and_nothing_is_forwarded(gw):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    response = await gw.client.post(
        "/rollouts/r1/v1/messages",
        json={"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]},
    )

    error = assert_openai_error(response, 400, "unsupported_content")
    assert "'image' blocks are not supported" in error["message"]
    assert gw.engine.requests == []


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},  # max_tokens is required
        {"model": "tiny", "max_tokens": 8, "messages": []},
        {"model": "tiny", "max_tokens": 8, "messages": [{"role": "tool", "content": "Hi"}]},
        {"model": "m" * 257, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
    ],
    ids=["no max_tokens", "no messages", "tool role in messages", "a model name past 256 characters"],
)
async def test_malformed_messages_requests_are_422(gw, body):
    response = await gw.client.post("/rollouts/r1/v1/messages", json=body)

    assert_openai_error(response, 422, "invalid_request")
    assert gw.engine.requests == []


async def test_count_tokens_asks_the_served_models_tokenizer(gw):
    gw.engine.answer("/tokenize", json_reply({"tokens": [1, 2, 3, 4, 5], "count": 5}))

    counted = await agent(gw).messages.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )

    assert counted.input_tokens == 5
    assert sent(gw)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


# What Claude Code 2.1 sends on its first call, abridged: an attribution block and cached blocks in the system
# prompt, a mid-conversation system message after the task, a deferred placeholder tool, and fields of
# Anthropic's API (metadata, adaptive thinking, context management, effort) a chat model has no use for.
CLAUDE_CODE_FIRST_CALL: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 512,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.330;"},
        {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>Attribution.</system-reminder>\n"},
                {"type": "text", "text": "Run echo hello"},
            ],
        },
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "# Environment\n"},
                {"type": "text", "text": "Skills.", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ],
    "tools": [
        TOOL,
        {
            "name": "DeferredToolPlaceholder",
            "description": "Keeps deferred tool loading active; never call this tool.",
            "input_schema": {"type": "object", "properties": {}},
            "defer_loading": True,
        },
    ],
    "metadata": {"user_id": '{"device_id": "d7da", "session_id": "5197"}'},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}
CLAUDE_CODE_HEADERS = {
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    "anthropic-version": "2023-06-01",
    "x-api-key": "x",
}


async def test_claude_codes_first_call_becomes_exactly_this_chat_request(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 2], "Hi"))

    response = await gw.client.post(
        "/rollouts/r1/v1/messages",
        params={"beta": "true"},
        json=CLAUDE_CODE_FIRST_CALL,
        headers=CLAUDE_CODE_HEADERS,
    )

    assert response.status_code == 200, response.text
    assert sent(gw) == {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a Claude agent."},
            {"role": "user", "content": "<system-reminder>Attribution.</system-reminder>\nRun echo hello"},
            {"role": "system", "content": "# Environment\nSkills."},
        ],
        "max_tokens": 512,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "ls",
                    "parameters": {"type": "object"},
                    "description": "List a directory.",
                },
            }
        ],
        "return_token_ids": True,
        "logprobs": True,
    }


async def test_claude_codes_attribution_block_is_not_part_of_the_system_prompt(gw):
    # Its hash changes with every request; vLLM would cut it as a line, taking "You are" with it.
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 2], "Hi"))
    attribution = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.330.fe5;"}

    await agent(gw).messages.create(
        model="tiny",
        max_tokens=64,
        system=[attribution, {"type": "text", "text": "You are an agent.\nBe brief."}],
        messages=[{"role": "user", "content": "Hi"}, {"role": "system", "content": [attribution]}],
    )

    assert sent(gw)["messages"] == [
        {"role": "system", "content": "You are an agent.\nBe brief."},
        {"role": "user", "content": "Hi"},
    ]


async def test_a_mid_conversation_system_message_keeps_its_place_between_the_turns(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 2], "Hi"))
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "The user is in /tmp."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Where am I?"},
    ]

    await agent(gw).messages.create(model="tiny", max_tokens=64, messages=messages)

    assert sent(gw)["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "The user is in /tmp."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Where am I?"},
    ]
    (turn,) = (await gw.rollout("r1", include_messages="true"))["turns"]
    assert [m["role"] for m in turn["messages"]] == ["user", "system", "assistant", "user"]


async def test_a_deferred_tool_is_left_out_of_the_prompt(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 2], "Hi"))
    deferred = {"name": "cron", "input_schema": {"type": "object"}, "defer_loading": True}

    await agent(gw).messages.create(
        model="tiny",
        max_tokens=64,
        messages=[{"role": "user", "content": "Hi"}],
        tools=[deferred, TOOL],
    )

    assert [tool["function"]["name"] for tool in sent(gw)["tools"]] == ["ls"]


async def test_a_system_message_holding_more_than_text_is_a_400_a_harness_can_fall_back_from(gw):
    # Claude Code announces tools added mid-conversation so; on a 400 it resends without system messages.
    addition = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "cron"}}
    body = {
        "model": "tiny",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": [addition]}],
    }

    response = await gw.client.post("/rollouts/r1/v1/messages", json=body)

    error = assert_openai_error(response, 400, "unsupported_content")
    assert (error["param"], error["message"]) == (
        "messages.1.content.0",
        "messages.1.content.0: only text blocks can go here",
    )
    assert gw.engine.requests == []


async def test_vllms_own_sampling_fields_pass_through_to_the_engine(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply(PROMPT, [5, 2], "ab"))
    extra = {"seed": 7, "min_tokens": 2, "structured_outputs": {"regex": "[ab]+"}, "top_k": 5}

    await agent(gw).messages.create(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body=extra
    )

    assert {key: sent(gw).get(key) for key in extra} == extra
