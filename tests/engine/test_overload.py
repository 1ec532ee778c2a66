"""Overload is not failure: calls beyond the connections a backend takes wait in a bounded queue, calls past
the bound are refused with a 503 their clients retry, and an engine too busy to answer stays in the fleet.

The engine is made as slow as a test needs with vLLM's own pause ("keep": what reaches it waits until it
resumes), so that every call is where the test says it is, however slow the machine."""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import aiohttp
import httpx
import orjson
import sqlalchemy as sa

from support import TIMEOUT, VLLM_HEADERS, assert_openai_error, metric, stored_rollout, until

STREAMS = 1024
CONNECTIONS = 64
TOKENS = 2
PROMPT = [11, 12, 13, 14]
"""Prompt ids: the call that costs the engine's server least (no template, no tokenizer), 1,024 times."""


def engine(vllm: Any, path: str, **kwargs: Any) -> None:
    """One of vLLM's own development endpoints (`/pause`, `/resume`)."""
    httpx.post(vllm.url + path, headers=VLLM_HEADERS, timeout=TIMEOUT, **kwargs).raise_for_status()


def open_files_for(connections: int) -> None:
    """The test process holds every agent's connection: raise its soft limit of open files if need be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < connections:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(connections, hard), hard))


async def streamed_call(agents: aiohttp.ClientSession, base_url: str) -> str | None:
    """One agent's streamed completion; the finish reason its last chunk gave, once [DONE] came.

    The agents' client is aiohttp, as a load generator's would be: the openai SDK's pool of 1,024
    connections costs the test process more CPU than the gateway spends on the calls."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "min_tokens": TOKENS, "stream": True}
    finish, done = None, False
    async with agents.post(base_url + "/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            data = line.removeprefix(b"data: ").strip()
            if data == b"[DONE]":
                done = True
            elif data:
                choices = orjson.loads(data)["choices"]
                finish = choices[0]["finish_reason"] if choices else finish
    return finish if done else None


def agents_for(calls: int) -> aiohttp.ClientSession:
    """The HTTP client of `calls` agents at once: a connection each."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=calls), timeout=aiohttp.ClientTimeout(total=TIMEOUT)
    )


def stored_turns(db_url: str, prefix: str) -> dict[str, list[tuple[str, int, int]]]:
    """The turns of the rollouts named `prefix...` as the documented SQL reads them (docs/sql.md): status,
    HTTP status, completion tokens."""
    query = sa.text(
        "SELECT rollout_id, status, http_status, completion_tokens FROM turns WHERE rollout_id LIKE :prefix "
        "ORDER BY rollout_id, turn_index"
    )
    stored: dict[str, list[tuple[str, int, int]]] = {}
    with sa.create_engine(db_url).connect() as connection:
        for rollout_id, *turn in connection.execute(query, {"prefix": prefix + "%"}):
            stored.setdefault(rollout_id, []).append(tuple(turn))
    return stored


def in_flight(gateway: Any, vllm: Any) -> float:
    return metric(gateway, f'gateway_backend_in_flight{{backend="{vllm.url}"}}')


def test_1024_streams_on_a_held_engine_wait_for_its_64_connections_and_all_finish_with_nothing_ejected(
    start_gateway, databases, vllm
):
    open_files_for(2 * STREAMS + 256)
    db_url = databases.new("sqlite")
    gw = start_gateway(
        db_url,
        "--max-connections", str(CONNECTIONS), "--max-queued", str(STREAMS),
        process=True,
    )  # fmt: skip
    rollouts = [f"burst-{i}" for i in range(STREAMS)]
    waiting = STREAMS - CONNECTIONS

    async def burst() -> list[str | None]:
        async with agents_for(STREAMS) as agents:
            engine(vllm, "/pause", params={"mode": "keep"})
            try:
                calls = [asyncio.create_task(streamed_call(agents, gw.agent_url(r))) for r in rollouts]
                await until(lambda: metric(gw, "gateway_calls_queued") == waiting, f"{waiting} calls queued")
                await until(lambda: in_flight(gw, vllm) == CONNECTIONS, f"{CONNECTIONS} calls on the engine")
            finally:
                engine(vllm, "/resume")
            return await asyncio.gather(*calls)

    finishes = asyncio.run(burst())

    assert finishes == ["length"] * STREAMS
    assert stored_turns(db_url, "burst-") == {rollout_id: [("ok", 200, TOKENS)] for rollout_id in rollouts}
    state = httpx.get(gw.url + "/admin/state", timeout=TIMEOUT).json()
    assert [(b["url"], b["healthy"], b["errors"]) for b in state["backends"]] == [(vllm.url, True, 0)]
    assert metric(gw, 'gateway_requests_total{endpoint="completions",status="200"}') == STREAMS
    assert metric(gw, 'gateway_stage_seconds_count{stage="queue"}') == waiting
    assert metric(gw, "gateway_calls_queued") == 0
    assert metric(gw, "gateway_relayed_tokens_total") == STREAMS * TOKENS


def test_a_call_past_the_queue_is_refused_with_a_503_to_retry_and_the_queued_calls_still_finish(
    start_gateway, databases, vllm
):
    gw = start_gateway(databases.new("sqlite"), "--max-connections", "1", "--max-queued", "2")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": TOKENS}

    async def overload() -> tuple[list[str | None], httpx.Response]:
        async with agents_for(3) as agents, httpx.AsyncClient(timeout=TIMEOUT) as client:
            engine(vllm, "/pause", params={"mode": "keep"})
            try:
                calls = [
                    asyncio.create_task(streamed_call(agents, gw.agent_url(f"held-{i}"))) for i in range(3)
                ]
                await until(lambda: metric(gw, "gateway_calls_queued") == 2, "two calls queued")
                await until(lambda: in_flight(gw, vllm) == 1, "one call on the engine")
                refused = await client.post(gw.agent_url("refused") + "/chat/completions", json=body)
            finally:
                engine(vllm, "/resume")
            return await asyncio.gather(*calls), refused

    finishes, refused = asyncio.run(overload())

    assert finishes == ["length"] * 3
    error = assert_openai_error(refused, 503, "queue_full")
    assert error["message"] == "2 calls already wait for a connection to a backend (--max-queued 2); retry"
    assert (refused.headers["retry-after"], refused.headers["x-should-retry"]) == ("1", "true")
    [turn] = stored_rollout(gw, "refused")["turns"]
    assert (turn["status"], turn["http_status"], turn["completion_token_ids"]) == ("error", 503, [])
    state = httpx.get(gw.url + "/admin/state", timeout=TIMEOUT).json()
    assert [(b["url"], b["healthy"]) for b in state["backends"]] == [(vllm.url, True)]
    assert metric(gw, 'gateway_errors_total{reason="503"}') == 1
