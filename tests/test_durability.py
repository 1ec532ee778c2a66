"""Nothing acknowledged is lost: crashes, restarts and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai

from support import async_agent, stored_rollout

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_killed_gateway_keeps_every_acknowledged_turn(start_gateway, databases, db_kind):
    db_url = databases.new(db_kind)
    first = start_gateway(db_url)

    async def agents() -> list[str]:
        async def one(i: int) -> str:
            agent = async_agent(first.agent_url(f"crash-{i}"))
            await agent.chat.completions.create(**CHAT)
            reply = await agent.chat.completions.create(**CHAT, stream=True)
            async for _ in reply:
                pass
            return f"crash-{i}"

        return await asyncio.gather(*(one(i) for i in range(8)))

    acknowledged = asyncio.run(agents())
    first.kill()  # SIGKILL: no shutdown hook runs

    second = start_gateway(db_url)
    for rollout_id in acknowledged:
        turns = httpx.get(f"{second.url}/rollouts/{rollout_id}", params={"include_tokens": "true"}).json()[
            "turns"
        ]
        assert [(t["status"], t["stream"]) for t in turns] == [("ok", False), ("ok", True)]
        assert turns[1]["prompt_token_ids"] == turns[0]["prompt_token_ids"]
    agent = openai.OpenAI(base_url=second.agent_url(acknowledged[0]), api_key="unused", max_retries=0)
    agent.chat.completions.create(**CHAT)
    assert [t["index"] for t in stored_rollout(second, acknowledged[0])["turns"]] == [0, 1, 2]


def test_client_leaving_mid_stream_leaves_a_cancelled_turn(long_gateway, rollout_id):
    # A reply far longer than socket buffers can hold, even if this client stalls for seconds on a loaded
    # machine before it leaves: the gateway is still relaying when the client goes (the long-context engine).
    gateway = long_gateway
    body = {**CHAT, "max_tokens": 30000, "min_tokens": 30000, "stream": True}
    with httpx.stream(
        "POST", gateway.agent_url(rollout_id) + "/chat/completions", json=body, timeout=300
    ) as response:
        received = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 5:
                break

    # On a loaded machine the gateway can take a minute to see that the client left (seen in CI: 75 s, the
    # engine's reply relayed meanwhile), and a read meanwhile more than 30 s; the turn is stored as cancelled
    # once it does.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TimeoutException):
            turns = httpx.get(f"{gateway.url}/rollouts/{rollout_id}", timeout=30).json().get("turns", [])
            if turns:
                break
        time.sleep(0.2)
    turns = stored_rollout(gateway, rollout_id)["turns"]
    assert turns, "no turn stored 300 s after the client left"
    turn = turns[0]
    assert turn["status"] == "cancelled"
    assert turn["error"] == "client disconnected before the end of the stream"
    assert len(turn["prompt_token_ids"]) > 0
    assert 4 <= len(turn["completion_token_ids"]) < 30000
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"])
