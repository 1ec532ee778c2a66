"""Many agents at once: every turn lands in its own rollout, and turns share commits."""

from __future__ import annotations

import asyncio

import httpx

from support import TIMEOUT, async_agent, stored_rollout, tokenize_chat

ROLLOUTS = 32


async def two_turn_agent(base_url: str, index: int, stream: bool) -> list[dict]:
    agent = async_agent(base_url)
    messages = [{"role": "user", "content": f"Agent {index}: count to three."}]
    sent = []
    for _ in range(2):
        sent.append(list(messages))
        if stream:
            text = ""
            async for chunk in await agent.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=6,
                temperature=1.0,
                seed=index,
                stream=True,
                extra_body={"min_tokens": 6},
            ):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        else:
            reply = await agent.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=6,
                temperature=1.0,
                seed=index,
                extra_body={"min_tokens": 6},
            )
            text = reply.choices[0].message.content
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    return sent


def test_32_concurrent_rollouts_are_all_recorded_exactly(gateway, vllm, db_url):
    group = httpx.post(gateway.url + "/rollouts", json={"group_id": "concurrent"}, timeout=TIMEOUT).json()[
        "group_id"
    ]
    ids = []
    for _ in range(ROLLOUTS):
        ids.append(
            httpx.post(gateway.url + "/rollouts", json={"group_id": group}, timeout=TIMEOUT).json()[
                "rollout_id"
            ]
        )
    commits_before = _commits(gateway)

    async def run() -> list[list[list[dict]]]:
        return await asyncio.gather(
            *(two_turn_agent(gateway.agent_url(rid), i, stream=i % 2 == 1) for i, rid in enumerate(ids))
        )

    conversations = asyncio.run(run())

    for rollout_id, sent in zip(ids, conversations, strict=True):
        rollout = stored_rollout(gateway, rollout_id)
        assert rollout["group_id"] == group
        assert [t["index"] for t in rollout["turns"]] == [0, 1]
        for turn, messages in zip(rollout["turns"], sent, strict=False):
            assert turn["status"] == "ok"
            assert turn["messages"] == messages
            assert turn["prompt_token_ids"] == tokenize_chat(vllm, messages)
            assert len(turn["completion_token_ids"]) == 6
    assert _commits(gateway) - commits_before < 2 * ROLLOUTS


def _commits(gateway) -> float:
    for line in httpx.get(gateway.url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith("gateway_store_commits_total "):
            return float(line.split()[1])
    raise AssertionError("gateway_store_commits_total missing from /metrics")
