"""The demo's agent in each dialect it speaks (`scripts/dev demo --dialect`), on the real engine: the same
conversation through chat completions, Anthropic Messages or OpenAI Responses is the same chat request for
vLLM, so its turns hold the same ids whatever the dialect."""

from __future__ import annotations

import asyncio

import pytest

from testbed.demo.agent import run_rollout

from support import on_store, stored_rollout

pytestmark = on_store("sqlite")


@pytest.fixture(scope="module")
def chat_turns(gateway):
    rollout_id = asyncio.run(run_rollout(gateway, "demo-chat", "What is in /tmp?", 3, seed=5))
    return stored_rollout(gateway, rollout_id)["turns"]


@pytest.mark.parametrize("dialect", ["messages", "responses"])
def test_the_demo_agent_makes_the_same_turns_in_every_dialect(gateway, chat_turns, dialect):
    rollout_id = asyncio.run(run_rollout(gateway, f"demo-{dialect}", "What is in /tmp?", 3, 5, dialect))

    rollout = stored_rollout(gateway, rollout_id)
    turns = rollout["turns"]
    assert [t["endpoint"] for t in turns] == [dialect] * 3
    assert [t["finish_reason"] for t in turns][:2] == ["tool_calls", "tool_calls"]
    assert [t["parent_turn"] for t in turns] == [None, 0, 1]
    assert rollout["status"] == "completed" and rollout["reward"] is not None
    for turn, chat in zip(turns, chat_turns, strict=True):
        assert turn["prompt_token_ids"] == chat["prompt_token_ids"]
        assert turn["completion_token_ids"] == chat["completion_token_ids"]
