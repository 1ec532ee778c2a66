"""How soon a call stops once its streaming client leaves: the engine's time the gateway spares.

    python bench/client_leaves.py [--tokens 200000] [--rates 500 5000 0] [--repeats 5]

An engine streams a reply of `--tokens` tokens at each of `--rates` tokens per second (0: as fast as its
connection takes them, an engine outpacing the gateway); the client reads five chunks and leaves. Printed per
rate (medians of `--repeats`): how long after the client left the gateway dropped the engine's call, how many
tokens the engine sent meanwhile, and the status the turn was stored with. The engine is a small in-process
server (vLLM on this machine never outpaces the gateway); the gateway is `gateway serve` on SQLite.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from aiohttp import web

from testbed.launcher import GatewayProcess
from testbed.process import free_port

TOKEN = {
    "choices": [
        {
            "index": 0,
            "delta": {"content": "a"},
            "token_ids": [7],
            "logprobs": {"content": [{"token": "a", "logprob": -0.5}]},
        }
    ]
}
FIRST = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant"}}]}


class Engine:
    """Streams `tokens` tokens at `rate` per second (0: unthrottled); notes when its call was dropped."""

    def __init__(self) -> None:
        self.tokens = 0
        self.rate = 0.0
        self.sent = 0
        self.dropped_at: float | None = None
        self.ended = asyncio.Event()

    def expect(self, tokens: int, rate: float) -> None:
        self.tokens, self.rate, self.sent, self.dropped_at = tokens, rate, 0, None
        self.ended = asyncio.Event()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def reply(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        event = b"data: " + orjson.dumps(TOKEN) + b"\n\n"
        try:
            await reply.write(b"data: " + orjson.dumps(FIRST) + b"\n\n")
            started = time.monotonic()
            for _ in range(self.tokens):
                await reply.write(event)
                self.sent += 1
                if self.rate:
                    await asyncio.sleep(max(0.0, started + self.sent / self.rate - time.monotonic()))
            await reply.write(b"data: [DONE]\n\n")
        except ConnectionError:
            self.dropped_at = time.monotonic()
        finally:
            self.ended.set()
        return reply


async def leave_once(
    client: httpx.AsyncClient,
    gateway: GatewayProcess,
    engine: Engine,
    rollout_id: str,
    tokens: int,
    rate: float,
) -> tuple[float | None, int, str]:
    """(seconds from leaving to the dropped call or None, tokens sent meanwhile, the stored status)."""
    engine.expect(tokens, rate)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": tokens,
    }
    async with client.stream(
        "POST", gateway.agent_url(rollout_id) + "/chat/completions", json=body
    ) as response:
        received = 0
        async for line in response.aiter_lines():
            received += line.startswith("data: ")
            if received == 5:
                break
    left, sent_then = time.monotonic(), engine.sent
    await asyncio.wait_for(engine.ended.wait(), 600)
    took = None if engine.dropped_at is None else engine.dropped_at - left
    while not (turns := (await client.get(f"{gateway.url}/rollouts/{rollout_id}")).json().get("turns")):
        await asyncio.sleep(0.05)
    return took, engine.sent - sent_then, turns[0]["status"]


async def run(args: argparse.Namespace, work: Path) -> None:
    engine = Engine()
    app = web.Application()
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/health", engine.health)
    app.router.add_post("/v1/chat/completions", engine.reply)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    gateway = GatewayProcess(
        [f"http://127.0.0.1:{port}"], f"sqlite:///{work}/bench.db", log_path=work / "gw.log"
    )
    await asyncio.to_thread(gateway.start)
    print(f"{'engine tok/s':>12} {'dropped after':>14} {'tokens after leaving':>21}  stored as")
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            for rate in args.rates:
                results = [
                    await leave_once(client, gateway, engine, f"r{rate}-{i}", args.tokens, rate)
                    for i in range(args.repeats)
                ]
                dropped = [took for took, _, _ in results if took is not None]
                after = statistics.median(sent for _, sent, _ in results)
                statuses = ", ".join(sorted({status for _, _, status in results}))
                when = f"{statistics.median(dropped) * 1000:.0f} ms" if dropped else "never"
                if dropped and len(dropped) < len(results):
                    when += f" ({len(results) - len(dropped)} never)"
                print(f"{rate or 'unlimited':>12} {when:>14} {after:>21,.0f}  {statuses}", flush=True)
    finally:
        await asyncio.to_thread(gateway.stop)
        await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=200_000, help="length of the engine's reply")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[500, 5000, 0], help="tokens/s; 0: unthrottled"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        asyncio.run(run(args, Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
