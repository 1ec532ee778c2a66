"""Several gateway replicas on one store: turns of the same rollout from both land once each, in order."""

from __future__ import annotations

import asyncio

import openai

from support import stored_rollout, tokenize_chat


def test_two_replicas_writing_one_rollout_never_collide(start_gateway, databases, db_kind, vllm, rollout_id):
    db_url = databases.new(db_kind)
    replicas = [start_gateway(db_url), start_gateway(db_url)]
    messages = [{"role": "user", "content": "Say something."}]

    async def call(i: int) -> None:
        agent = openai.AsyncOpenAI(
            base_url=replicas[i % 2].agent_url(rollout_id), api_key="unused", max_retries=0
        )
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
