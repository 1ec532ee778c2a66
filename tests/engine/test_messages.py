"""The Anthropic Messages dialect on the real engine, through the unmodified `anthropic` SDK: each call is a
turn whose prompt ids are what vLLM renders for the translated conversation and whose completion ids and
logprobs are the engine's; a tool round trip extends its first turn, spliced onto its exact ids in exact
mode."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from support import LS_TMP_REGEX, TIMEOUT, detokenize, on_store, stored_rollout, tokenize_chat

pytestmark = on_store("sqlite")

TOOL = {
    "name": "ls",
    "description": "List a directory.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "ls", "description": "List a directory.", "parameters": TOOL["input_schema"]},
}


def rollout(gateway, **body) -> tuple[str, anthropic.Anthropic]:
    created = httpx.post(
        gateway.url + "/rollouts", json={"group_id": "messages", **body}, timeout=TIMEOUT
    ).json()
    agent = anthropic.Anthropic(
        api_key="unused", base_url=created["anthropic_base_url"], max_retries=0, timeout=TIMEOUT
    )
    return created["rollout_id"], agent


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_messages_call_is_a_turn_with_the_engines_exact_ids(gateway, vllm, stream):
    rollout_id, agent = rollout(gateway)
    request = {
        "model": "tiny",
        "max_tokens": 12,
        # Plain words: a random model may otherwise sample a special token that the reply's text hides.
        "extra_body": {"structured_outputs": {"regex": "[a-z]+( [a-z]+)*"}},
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say something."}],
    }

    if stream:
        with agent.messages.stream(**request) as events:
            names = [event.type for event in events]
            reply = events.get_final_message()
        assert (names[0], names[-1]) == ("message_start", "message_stop")
    else:
        reply = agent.messages.create(**request)

    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, chat)
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"]) == reply.usage.output_tokens
    text = "".join(block.text for block in reply.content if block.type == "text")
    assert detokenize(vllm, turn["completion_token_ids"]).startswith(text)
    assert (turn["content"] or "", turn["stream"]) == (text, stream)
    assert reply.stop_reason == ("max_tokens" if turn["finish_reason"] == "length" else "end_turn")


@pytest.mark.parametrize("mode", ["passthrough", "exact"])
def test_a_tool_round_trip_extends_the_first_turn(gateway, vllm, mode):
    # The rollout's sampling makes the random tiny model call the tool first.
    sampling = {"structured_outputs": {"regex": LS_TMP_REGEX}, "max_tokens": 60, "temperature": 0.0}
    rollout_id, agent = rollout(gateway, mode=mode, sampling=sampling)
    messages = [{"role": "user", "content": "What is in /tmp?"}]

    first = agent.messages.create(model="tiny", max_tokens=100, messages=messages, tools=[TOOL])
    (use,) = first.content
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.txt"}]},
    ]
    agent.messages.create(model="tiny", max_tokens=100, messages=messages, tools=[TOOL])

    assert (first.stop_reason, use.type, use.name, use.input) == (
        "tool_use",
        "tool_use",
        "ls",
        {"path": "/tmp"},
    )
    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert [t["parent_turn"] for t in turns] == [None, 0]
    exact = turns[0]["prompt_token_ids"] + turns[0]["completion_token_ids"]
    if mode == "exact":
        assert [t["splice"] for t in turns] == ["render", "exact"]
        assert turns[1]["prompt_token_ids"][: len(exact)] == exact
    assert turns[0]["prompt_token_ids"] == tokenize_chat(
        vllm, [{"role": "user", "content": "What is in /tmp?"}], [CHAT_TOOL]
    )
