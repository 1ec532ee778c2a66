"""Tool-using, multi-turn rollouts: parsed tool calls, exact prompts every turn, linear storage."""

from __future__ import annotations

import json

import openai
import sqlalchemy as sa

from rollout_store.database import make_engine

from support import (
    LS_TMP_CALL,
    LS_TMP_REGEX,
    TOOLS,
    detokenize,
    on_store,
    stored_rollout,
    streamed_reply,
    sync_agent,
    tokenize_chat,
)

pytestmark = on_store("postgresql")

FORCE_LS = {"structured_outputs": {"regex": LS_TMP_REGEX}}


def agent(gateway, rollout_id: str) -> openai.OpenAI:
    return sync_agent(gateway.agent_url(rollout_id))


def test_forced_tool_call_is_parsed_for_the_agent_and_stored_with_its_markup_ids(
    gateway, vllm, db_url, rollout_id
):
    messages = [{"role": "user", "content": "What is in /tmp?"}]
    reply = agent(gateway, rollout_id).chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=80, temperature=0.0, extra_body=FORCE_LS
    )

    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("ls", {"path": "/tmp"})
    turn = stored_rollout(gateway, rollout_id)["turns"][0]
    assert turn["finish_reason"] == "tool_calls"
    assert turn["tool_calls"][0]["function"]["name"] == "ls"
    assert json.loads(turn["tool_calls"][0]["function"]["arguments"]) == {"path": "/tmp"}
    assert turn["tools"] == TOOLS
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, messages, TOOLS)
    assert detokenize(vllm, turn["completion_token_ids"]).startswith(LS_TMP_CALL)


def test_streamed_tool_call_is_assembled_like_the_whole_one(gateway, db_url, rollout_id):
    messages = [{"role": "user", "content": "What is in /tmp?"}]
    stream = agent(gateway, rollout_id).chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        max_tokens=80,
        temperature=0.0,
        extra_body=FORCE_LS,
        stream=True,
    )
    finish = [
        chunk.choices[0].finish_reason for chunk in stream if chunk.choices and chunk.choices[0].finish_reason
    ]

    turn = stored_rollout(gateway, rollout_id)["turns"][0]
    assert finish == ["tool_calls"]
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["ls"]
    assert json.loads(turn["tool_calls"][0]["function"]["arguments"]) == {"path": "/tmp"}


def run_tool_agent(client: openai.OpenAI, turns: int, stream: bool) -> list[list[dict]]:
    """A harness in the usual shape: call, run the tool, append both, call again. Returns each call's
    messages."""
    messages: list[dict] = [
        {"role": "system", "content": "You can list directories."},
        {"role": "user", "content": "What is in /tmp?"},
    ]
    sent = []
    for _ in range(turns):
        sent.append(list(messages))
        kwargs = {
            "model": "tiny",
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 80,
            "temperature": 0.0,
            "extra_body": FORCE_LS,
        }
        if stream:
            tool_calls = streamed_reply(client.chat.completions.create(**kwargs, stream=True))["tool_calls"]
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            tool_calls = [c.model_dump() for c in message.tool_calls]
        messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
        messages.append({"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "a.txt\nb.txt"})
    return sent


def test_multi_turn_tool_rollout_stores_every_prompt_exactly(gateway, vllm, db_url, rollout_id):
    sent = run_tool_agent(agent(gateway, rollout_id), turns=3, stream=False)

    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert [t["index"] for t in turns] == [0, 1, 2]
    for turn, messages in zip(turns, sent, strict=False):
        assert turn["messages"] == messages
        assert turn["prompt_token_ids"] == tokenize_chat(vllm, messages, TOOLS)
        assert turn["finish_reason"] == "tool_calls"
    assert [t["parent_turn"] for t in turns] == [None, 0, 1]


def test_streamed_multi_turn_rollout_stores_the_same_prompts(gateway, vllm, db_url, rollout_id):
    sent = run_tool_agent(agent(gateway, rollout_id), turns=3, stream=True)

    turns = stored_rollout(gateway, rollout_id)["turns"]
    for turn, messages in zip(turns, sent, strict=False):
        assert turn["prompt_token_ids"] == tokenize_chat(vllm, messages, TOOLS)


def test_turns_store_only_what_is_new_against_their_parent(gateway, db_url, rollout_id):
    run_tool_agent(agent(gateway, rollout_id), turns=3, stream=False)

    full = stored_rollout(gateway, rollout_id)["turns"]
    engine = make_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT turn_index, prefix_tokens, prompt_ids, prefix_messages, messages FROM turns "
                "WHERE rollout_id = :r ORDER BY turn_index"
            ),
            {"r": rollout_id},
        ).all()
    engine.dispose()
    for row, turn in zip(rows, full, strict=False):
        stored_ids = len(row.prompt_ids) // 4
        assert row.prefix_tokens + stored_ids == turn["prompt_tokens"]
    # Turn 1 shares the whole of turn 0's prompt; it stores only the reply's re-rendering and the tool result.
    assert rows[1].prefix_tokens >= full[0]["prompt_tokens"]
    assert rows[1].prefix_messages == 2
    messages_1 = rows[1].messages if isinstance(rows[1].messages, list) else json.loads(rows[1].messages)
    assert [m["role"] for m in messages_1] == ["assistant", "tool"]
