"""A rollout shaped as Claude Code shapes one, on the real engine in exact mode: a main conversation that
hands two tasks to sub-agents running at the same time, their answers returned as tool results, a summary call
that compacts the conversation, a restart from the summary whose first call the client retried. Merged,
every chain of the lineage tree is one sample, token for token the engine's ids, every sampled token
trained once; `rollout_chains` lists the same chains, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import sqlalchemy as sa

from rollout_store.database import make_engine
from trainer_client import SampleOptions, TrainerClient

from support import LS_TMP_REGEX, TIMEOUT, TOOLS, async_agent, sent_back, stored_rollout

SYSTEM = {"role": "system", "content": "You are a coding agent."}
SUB_SYSTEM = {"role": "system", "content": "You are a sub-agent: answer in two words."}
WORDS = {"structured_outputs": {"regex": "[a-z]{3} [a-z]{3}"}}
TWO_CALLS = {"structured_outputs": {"regex": LS_TMP_REGEX + LS_TMP_REGEX}}
ONE_CALL = {"structured_outputs": {"regex": LS_TMP_REGEX}}


async def ask(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]], shape: dict[str, Any], **kw: Any
) -> Any:
    """One greedy call; replies end on the model's own end token, so exact mode splices the next turn."""
    reply = await client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=200, temperature=0.0, extra_body=shape, **kw
    )
    return sent_back(reply.choices[0].message)


async def sub_agent(client: openai.AsyncOpenAI, task: str) -> str:
    """A fresh conversation of its own: a tool call, then an answer."""
    messages: list[dict[str, Any]] = [SUB_SYSTEM, {"role": "user", "content": task}]
    call = await ask(client, messages, ONE_CALL)
    messages += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "a.txt"}]
    return str((await ask(client, messages, WORDS))["content"])


async def claude_code_like(base_url: str) -> None:
    async with async_agent(base_url) as client:
        main: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
        delegate = await ask(client, main, TWO_CALLS)  # two Task calls at once
        first, second = delegate["tool_calls"]
        answers = await asyncio.gather(
            sub_agent(client, "read the code"), sub_agent(client, "read the tests")
        )
        main += [
            delegate,
            {"role": "tool", "tool_call_id": first["id"], "content": answers[0]},
            {"role": "tool", "tool_call_id": second["id"], "content": answers[1]},
        ]
        main += [await ask(client, main, WORDS), {"role": "user", "content": "Summarize the conversation."}]
        summary = (await ask(client, main, WORDS))["content"]
        restart: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"Summary: {summary}. Go on."}]
        await ask(client, restart, WORDS)  # its reply is lost to a timeout: the client retries
        retried = await ask(client, restart, WORDS, extra_headers={"x-stainless-retry-count": "1"})
        restart += [retried, {"role": "user", "content": "Done?"}]
        await ask(client, restart, WORDS)


def conversation_of(turn: dict[str, Any]) -> str:
    first_user = next(m["content"] for m in turn["messages"] if m["role"] == "user")
    return {"Fix the failing test.": "main", "read the code": "code", "read the tests": "tests"}.get(
        first_user, "restart"
    )


def test_each_chain_of_a_rollout_with_sub_agents_a_compaction_and_a_retry_trains_once(
    start_gateway, databases, db_kind
):
    db_url = databases.new(db_kind)
    gateway = start_gateway(db_url, "--mode", "exact")
    rollout = httpx.post(f"{gateway.url}/rollouts", json={"group_id": "g"}, timeout=TIMEOUT).json()

    asyncio.run(claude_code_like(rollout["base_url"]))
    finish = {"reward": 1.0}
    httpx.post(f"{gateway.url}/rollouts/{rollout['rollout_id']}/finish", json=finish, timeout=TIMEOUT)

    turns = stored_rollout(gateway, rollout["rollout_id"])["turns"]
    by_conversation: dict[str, list[int]] = {}
    for turn in turns:
        by_conversation.setdefault(conversation_of(turn), []).append(turn["index"])
    assert {name: len(indices) for name, indices in by_conversation.items()} == {
        "main": 3, "code": 2, "tests": 2, "restart": 3
    }  # fmt: skip
    lost, retry, last = by_conversation["restart"]
    assert turns[retry]["retry_of"] == lost
    expected = sorted(
        [by_conversation["main"], by_conversation["code"], by_conversation["tests"], [lost], [retry, last]]
    )
    assert [t["splice"] for t in turns if t["parent_turn"] is not None] == ["exact"] * 5

    with TrainerClient(db_url) as client:
        samples = client.read(SampleOptions(merged=True)).samples

    assert [s.turn_indices for s in samples] == expected
    for sample in samples:  # token for token: the last turn's ids, loss on each trained turn's sampled ids
        end = turns[sample.turn_indices[-1]]
        assert sample.input_ids.tolist() == end["prompt_token_ids"] + end["completion_token_ids"]
        mask = [0] * len(sample.input_ids)
        for index in sample.turn_indices:
            start = len(turns[index]["prompt_token_ids"])
            for at in range(start, start + len(turns[index]["completion_token_ids"])):
                mask[at] = 0 if index == lost else 1
        assert sample.loss_mask.tolist() == mask
    trained = sum(int(s.loss_mask.sum()) for s in samples)
    assert trained == sum(len(t["completion_token_ids"]) for t in turns if t["index"] != lost)
    engine = make_engine(db_url)
    with engine.connect() as conn:
        listed = conn.execute(
            sa.text(
                "SELECT turn_indices, sampled_tokens FROM rollout_chains WHERE rollout_id = :r ORDER BY chain"
            ),
            {"r": rollout["rollout_id"]},
        ).all()
    engine.dispose()
    assert [row.turn_indices for row in listed] == [",".join(map(str, s.turn_indices)) for s in samples]
    assert [row.sampled_tokens for row in listed] == [
        sum(len(turns[i]["completion_token_ids"]) for i in s.turn_indices) for s in samples
    ]
