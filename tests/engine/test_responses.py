"""The OpenAI Responses dialect on the real engine, through the unmodified `openai` SDK and the OpenAI Agents
SDK: each call is a turn whose prompt ids are what vLLM renders for the translated conversation and whose
completion ids and logprobs are the engine's; a function-call round trip through `previous_response_id`
extends its first turn, spliced onto its exact ids in exact mode."""

from __future__ import annotations

import asyncio
from typing import Any

import agents
import httpx
import openai
import pytest

from support import (
    LS_TMP_REGEX,
    TIMEOUT,
    TOOLS,
    async_agent,
    detokenize,
    on_store,
    stored_rollout,
    sync_agent,
    tokenize_chat,
)

pytestmark = on_store("postgresql")

TOOL = {"type": "function", "name": "ls", **{k: v for k, v in TOOLS[0]["function"].items() if k != "name"}}


def rollout(gateway, **body) -> tuple[str, openai.OpenAI]:
    created = httpx.post(
        gateway.url + "/rollouts", json={"group_id": "responses", **body}, timeout=TIMEOUT
    ).json()
    return created["rollout_id"], sync_agent(created["base_url"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_response_is_a_turn_with_the_engines_exact_ids(gateway, vllm, stream):
    rollout_id, agent = rollout(gateway)
    request: dict[str, Any] = {
        "model": "tiny",
        "instructions": "Be brief.",
        "input": "Say something.",
        "max_output_tokens": 12,
        # Plain words: a random model may otherwise sample a special token that the reply's text hides.
        "extra_body": {"structured_outputs": {"regex": "[a-z]+( [a-z]+)*"}},
    }

    if stream:
        events = list(agent.responses.create(**request, stream=True))
        reply = events[-1].response  # completed, or incomplete when the reply reached max_output_tokens
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[-1].type == f"response.{reply.status}"
    else:
        reply = agent.responses.create(**request)

    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    assert turn["prompt_token_ids"] == tokenize_chat(vllm, chat)
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"]) == reply.usage.output_tokens
    assert detokenize(vllm, turn["completion_token_ids"]).startswith(reply.output_text)
    assert (turn["content"] or "", turn["stream"], turn["response_id"]) == (
        reply.output_text,
        stream,
        reply.id,
    )
    assert reply.status == ("incomplete" if turn["finish_reason"] == "length" else "completed")
    assert agent.responses.retrieve(reply.id).output_text == reply.output_text


@pytest.mark.parametrize("mode", ["passthrough", "exact"])
def test_a_function_call_round_trip_through_previous_response_id_extends_the_first_turn(gateway, vllm, mode):
    rollout_id, agent = rollout(gateway, mode=mode)

    first = agent.responses.create(
        model="tiny",
        input="What is in /tmp?",
        tools=[TOOL],
        max_output_tokens=60,
        temperature=0.0,
        extra_body={"structured_outputs": {"regex": LS_TMP_REGEX}},
    )
    (call,) = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}
    second = agent.responses.create(
        model="tiny", input=[output], previous_response_id=first.id, tools=[TOOL], max_output_tokens=8
    )

    assert (call.type, call.name, call.arguments) == ("function_call", "ls", '{"path": "/tmp"}')
    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert [t["parent_turn"] for t in turns] == [None, 0]
    assert [t["response_id"] for t in turns] == [first.id, second.id]
    history = [
        {"role": "user", "content": "What is in /tmp?"},
        {"role": "assistant", "content": None, "tool_calls": turns[0]["tool_calls"]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "a.txt"},
    ]
    assert turns[1]["messages"] == history
    exact = turns[0]["prompt_token_ids"] + turns[0]["completion_token_ids"]
    if mode == "exact":
        assert [t["splice"] for t in turns] == ["render", "exact"]
        assert turns[1]["prompt_token_ids"][: len(exact)] == exact
    else:
        assert turns[1]["prompt_token_ids"] == tokenize_chat(vllm, history, TOOLS)


def test_an_agents_sdk_agent_runs_its_function_tool_and_sends_the_result_back(gateway, vllm):
    sampling = {"structured_outputs": {"regex": LS_TMP_REGEX}, "temperature": 0.0, "max_tokens": 60}
    created = httpx.post(
        gateway.url + "/rollouts", json={"group_id": "agents-sdk", "sampling": sampling}, timeout=TIMEOUT
    ).json()
    listed: list[str] = []

    @agents.function_tool
    def ls(path: str) -> str:
        """List a directory."""
        listed.append(path)
        return "a.txt b.txt"

    client = async_agent(created["base_url"])
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
    agent = agents.Agent(name="lister", instructions="You list directories.", tools=[ls], model=model)
    agents.set_tracing_disabled(True)

    # Every call of the rollout is made to call the tool: the run ends at its turn limit.
    with pytest.raises(agents.MaxTurnsExceeded):
        asyncio.run(agents.Runner.run(agent, "What is in /tmp?", max_turns=2))

    turns = stored_rollout(gateway, created["rollout_id"])["turns"]
    assert listed == ["/tmp", "/tmp"]
    assert [(t["endpoint"], t["status"], t["parent_turn"]) for t in turns] == [
        ("responses", "ok", None),
        ("responses", "ok", 0),
    ]
    (result,) = [m for m in turns[1]["messages"] if m["role"] == "tool"]
    assert result["content"] == "a.txt b.txt"
    for turn in turns:
        assert turn["prompt_token_ids"] == tokenize_chat(vllm, turn["messages"], turn["tools"])
        assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"]) > 0
