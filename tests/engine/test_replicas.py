"""Several gateway replicas on one store: turns of the same rollout from both land once each, in order, and a
rollout one replica finished takes no turn through another."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from support import TIMEOUT, async_agent, stored_rollout, sync_agent, tokenize_chat


def test_two_replicas_writing_one_rollout_never_collide(start_gateway, databases, db_kind, vllm, rollout_id):
    db_url = databases.new(db_kind)
    replicas = [start_gateway(db_url, process=True), start_gateway(db_url, process=True)]
    messages = [{"role": "user", "content": "Say something."}]

    async def call(i: int) -> None:
        agent = async_agent(replicas[i % 2].agent_url(rollout_id))
        await agent.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3, extra_body={"min_tokens": 3}
        )

    async def waves() -> None:
        for _ in range(3):
            await asyncio.gather(*(call(i) for i in range(8)))

    asyncio.run(waves())

    turns = stored_rollout(replicas[0], rollout_id)["turns"]
    assert [t["index"] for t in turns] == list(range(24))
    assert {t["status"] for t in turns} == {"ok"}
    prompt = tokenize_chat(vllm, messages)
    assert all(t["prompt_token_ids"] == prompt for t in turns)
    assert all(len(t["completion_token_ids"]) == 3 for t in turns)


def test_a_rollout_finished_through_one_replica_takes_no_turn_through_another(
    start_gateway, databases, db_kind, vllm, rollout_id
):
    db_url = databases.new(db_kind)
    writer, finisher = start_gateway(db_url, process=True), start_gateway(db_url, process=True)
    agent = sync_agent(writer.agent_url(rollout_id))
    messages = [{"role": "user", "content": "Say something."}]
    agent.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3
    )  # the writer knows it running

    finished = httpx.post(
        f"{finisher.url}/rollouts/{rollout_id}/finish", json={"reward": 1.0}, timeout=TIMEOUT
    )
    assert finished.status_code == 200, finished.text
    with pytest.raises(openai.ConflictError) as refused:
        agent.chat.completions.create(model="tiny", messages=messages, max_tokens=3)

    assert refused.value.code == "rollout_finished"
    stored = stored_rollout(writer, rollout_id)
    assert (stored["status"], stored["reward"], len(stored["turns"])) == ("completed", 1.0, 1)
