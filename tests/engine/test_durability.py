"""Nothing acknowledged is lost: crashes, restarts and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import threading

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.turns.recording import CANCELLED
from testbed.launcher import GatewayProcess
from testbed.process import free_port

from support import TIMEOUT, async_agent, stored_rollout, sync_agent, wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def gateway(start_gateway, databases, db_kind):
    """A gateway of the test's own: a 30,000-token reply keeps the engine busy for seconds, and a gateway that
    sees its engine slow to answer health checks may take it out of service for a while (not the session's
    gateway, then)."""
    return start_gateway(databases.new(db_kind))


def test_killed_gateway_keeps_every_acknowledged_turn(start_gateway, databases, db_kind):
    db_url = databases.new(db_kind)
    first = start_gateway(db_url, process=True)

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

    second = start_gateway(db_url, process=True)
    for rollout_id in acknowledged:
        turns = httpx.get(
            f"{second.url}/rollouts/{rollout_id}", params={"include_tokens": "true"}, timeout=TIMEOUT
        ).json()["turns"]
        assert [(t["status"], t["stream"]) for t in turns] == [("ok", False), ("ok", True)]
        assert turns[1]["prompt_token_ids"] == turns[0]["prompt_token_ids"]
    agent = sync_agent(second.agent_url(acknowledged[0]))
    agent.chat.completions.create(**CHAT)
    assert [t["index"] for t in stored_rollout(second, acknowledged[0])["turns"]] == [0, 1, 2]


def test_client_leaving_mid_stream_leaves_a_cancelled_turn(gateway, rollout_id):
    # A reply far longer than socket buffers can hold, even if this client stalls for seconds on a loaded
    # machine before it leaves: the gateway is still relaying when the client goes.
    body = {**CHAT, "max_tokens": 30000, "min_tokens": 30000, "stream": True}
    with httpx.stream(
        "POST", gateway.agent_url(rollout_id) + "/chat/completions", json=body, timeout=TIMEOUT
    ) as response:
        received = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 5:
                break

    # The turn is stored as cancelled as soon as the gateway sees the client left.
    wait_for(lambda: stored_rollout(gateway, rollout_id)["turns"], "the cancelled turn stored")
    (turn,) = stored_rollout(gateway, rollout_id)["turns"]
    assert turn["status"] == "cancelled"
    assert turn["error"] == CANCELLED
    assert len(turn["prompt_token_ids"]) > 0
    assert 4 <= len(turn["completion_token_ids"]) < 30000
    assert len(turn["completion_logprobs"]) == len(turn["completion_token_ids"])


class OutpacingEngine:
    """An engine faster than the gateway, which vLLM on this machine never is: it streams a reply of
    `chunks` tokens as fast as its connection takes them, and says whether the gateway dropped the call
    before the reply's end. It serves from a thread of its own, as a server in another process would."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.dropped = False
        self.ended = threading.Event()
        """The reply ended: sent whole, or the gateway dropped it."""
        self.port = free_port()
        self._listening = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OutpacingEngine:
        self._thread.start()
        assert self._listening.wait(30)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(30)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop: asyncio.Future[None] = self._loop.create_future()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._reply)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._listening.set()
        await self._stop
        await runner.cleanup()

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _reply(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        first = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        token = {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "a"},
                    "token_ids": [7],
                    "logprobs": {"content": [{"token": "a", "logprob": -0.5}]},
                }
            ]
        }
        event = b"data: " + orjson.dumps(token) + b"\n\n"
        try:
            await reply.write(b"data: " + orjson.dumps(first) + b"\n\n")
            for _ in range(self.chunks):
                await reply.write(event)
            await reply.write(b"data: [DONE]\n\n")
        except ConnectionError:
            self.dropped = True
        finally:
            self.ended.set()
        return reply


@pytest.mark.engine  # starts `gateway serve` as a process
def test_a_client_leaving_a_stream_stops_the_call_at_once_even_when_the_engine_outpaces_the_gateway(tmp_path):
    """The gateway stops relaying at its next chunk once the client has left, drops the engine's call and
    stores the turn as cancelled. (Starlette's cancellation alone did not reach a relay that found the
    engine's next output already there each time it looked: the whole reply went to nobody, and the turn
    was stored as answered.)"""
    with (
        OutpacingEngine(chunks=200_000) as engine,
        GatewayProcess(
            [engine.url], f"sqlite:///{tmp_path}/gateway.db", log_path=tmp_path / "gateway.log"
        ) as gateway,
    ):
        body = {**CHAT, "max_tokens": 200_000, "stream": True}
        with httpx.stream(
            "POST", gateway.agent_url("leaves") + "/chat/completions", json=body, timeout=TIMEOUT
        ) as response:
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 5:
                    break

        assert engine.ended.wait(60)
        wait_for(
            lambda: bool(httpx.get(f"{gateway.url}/rollouts/leaves", timeout=TIMEOUT).json().get("turns"))
        )
        (turn,) = stored_rollout(gateway, "leaves")["turns"]

    assert engine.dropped, "the gateway relayed the engine's whole reply after the client left"
    assert (turn["status"], turn["error"]) == (
        "cancelled",
        CANCELLED,
    )
    assert 4 <= len(turn["completion_token_ids"]) < 200_000
