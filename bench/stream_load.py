"""Streamed load: many agents streaming replies at once, directly from a vLLM-shaped upstream and through the
gateway, in one run. The gateway's cost at fleet scale is its work per relayed token, not per call.

    python bench/stream_load.py [--concurrency 64 256] [--tokens 256] [--body-kb 12.7] [--pace-ms 0]
                                [--seconds 10] [--workers 2] [--rounds 3]

The upstream (`StreamingUpstream`, a child process) streams each reply as vLLM does with `return_token_ids`
and `logprobs`: a first chunk with the role and the prompt's ids, then one chunk per token (its text, id and
logprob), the finish, the usage and `[DONE]`; `--pace-ms` waits between a stream's chunks (0: as fast as the
event loop turns, each chunk its own write). Each of `--concurrency` connections calls in a loop for
`--seconds`, in rollouts of 20 calls through the gateway (as `bench/gateway_overhead.py`); the load
generator is a raw-socket HTTP/1.1 client (`Connection`, large_bodies.py's and soak.py's too). It prints
tokens/s, calls/s and time to the first token (p50, p99) directly and through the gateway (SQLite; with
`--workers N`, PostgreSQL behind `gateway serve --workers N` too), and their ratio. Every process shares this
machine's cores. With `--rounds N` each target runs N times, the upstream directly and through each gateway
in turn, and the median ratio is printed: on a machine whose speed drifts (a shared virtual machine), a ratio
to the direct run just before is steadier than one run of each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import fake_vllm
import orjson
from gateway_overhead import POSTGRES_URL, paths_for, postgres_schemas

from testbed.launcher import GatewayProcess


def stream_chunks(tokens: int) -> list[bytes]:
    """A whole streamed reply of `tokens` tokens after its head, one chunk a token (as vLLM writes it)."""
    deltas = [({"content": "x"}, [(i * 37) % 2000]) for i in range(tokens)]
    return fake_vllm.stream_events(fake_vllm.PROMPT_IDS, deltas, "length")


class StreamingUpstream(fake_vllm.Requests):
    """Streams `chunks` for every POST; answers anything else (the gateway's health checks) with `{}`."""

    chunks: ClassVar[list[bytes]] = []
    pace: ClassVar[float] = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.queue: asyncio.Queue[bool] = asyncio.Queue()
        self.task = asyncio.ensure_future(self.serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.task.cancel()

    def answer(self, head: bytes, body: bytes) -> None:
        """Queued: a stream's chunks are paced, and the next call on the connection waits for them."""
        self.queue.put_nowait(head.startswith(b"post "))

    async def serve(self) -> None:
        while True:
            streamed = await self.queue.get()
            if not streamed:
                self.transport.write(fake_vllm.http_reply(b"{}"))
                continue
            self.transport.write(fake_vllm.STREAM_HEAD)
            for chunk in self.chunks:
                self.transport.write(chunk)
                await asyncio.sleep(self.pace)


async def serve(port: int, tokens: int, pace_ms: float) -> None:
    StreamingUpstream.chunks = stream_chunks(tokens)
    StreamingUpstream.pace = pace_ms / 1000
    await fake_vllm.serve(StreamingUpstream, port)


def agent_body(kb: float, tokens: int) -> bytes:
    """A chat request of about `kb` KB that streams `tokens` tokens."""
    words = " ".join(f"word{i % 97}" for i in range(int(kb * 1024 / 7) + 10))[: int(kb * 1024) - 200]
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": words}]
    return orjson.dumps({"model": "tiny", "messages": messages, "max_tokens": tokens, "stream": True})


@dataclass
class Tally:
    calls: int = 0
    failed: int = 0
    first_token_ms: list[float] = field(default_factory=list)


_POST = b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"


class Connection:
    """One keep-alive HTTP/1.1 connection to 127.0.0.1 (a raw client: the load generator shares the machine,
    so its cost per call must be small beside the gateway's)."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 20)

    def close(self) -> None:
        self.writer.close()

    async def request(self, path: str, body: bytes) -> tuple[int, int | None]:
        """Send a POST, head and body in one write (one piece to the server where it fits); its status and
        its body's length (None: chunked)."""
        self.writer.writelines((_POST % (path.encode(), len(body)), body))
        line = await self.reader.readline()
        if not line:
            raise ConnectionResetError("the server closed the connection")
        status = int(line.split()[1])
        length: int | None = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            lower = line.lower()
            if lower.startswith(b"content-length:"):
                length = int(line.split(b":")[1])
            elif lower.startswith(b"transfer-encoding:") and b"chunked" in lower:
                length = None
        return status, length

    async def chunk(self) -> bytes | None:
        """The next chunk of a chunked body, with its closing CRLF (None after the last)."""
        size = int((await self.reader.readline()).strip(), 16)
        if size == 0:
            await self.reader.readline()
            return None
        return await self.reader.readexactly(size + 2)

    async def body(self, length: int | None) -> bytes:
        """A body of `length` bytes, or a chunked one's chunks joined (each with its CRLF)."""
        if length is not None:
            return await self.reader.readexactly(length)
        parts = []
        while (part := await self.chunk()) is not None:
            parts.append(part)
        return b"".join(parts)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """Status and body."""
        status, length = await self.request(path, body)
        return status, await self.body(length)


async def stream_call(connection: Connection, path: str, body: bytes) -> float:
    """One streamed call: its time to the first token (ms); raises on failure."""
    started = time.perf_counter()
    status, _ = await connection.request(path, body)
    if status != 200:
        raise RuntimeError(f"status {status}")
    events = 0
    first = 0.0
    while (data := await connection.chunk()) is not None:
        events += data.count(b"data: ")
        if not first and events >= 2:  # the role's event, then the first token's
            first = (time.perf_counter() - started) * 1000
    return first


async def load(
    port: int, through_gateway: bool, body: bytes, concurrency: int, seconds: float
) -> tuple[Tally, float]:
    tally = Tally()
    deadline = time.perf_counter() + seconds

    async def calls() -> None:
        connection = Connection(port)
        await connection.open()
        paths = paths_for("gateway" if through_gateway else "direct")
        try:
            while time.perf_counter() < deadline:
                path = next(paths)
                try:
                    tally.first_token_ms.append(await stream_call(connection, path, body))
                    tally.calls += 1
                except (RuntimeError, ValueError, asyncio.IncompleteReadError, ConnectionError):
                    tally.failed += 1
                    connection.close()
                    await connection.open()
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(calls() for _ in range(concurrency)))
    return tally, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else 0.0)


def report(name: str, tally: Tally, elapsed: float, tokens: int, floor: float | None) -> float:
    rate = tally.calls * tokens / elapsed
    ratio = f"{rate / floor:>6.2f}" if floor else f"{'':>6}"
    p50, p99 = percentile(tally.first_token_ms, 50), percentile(tally.first_token_ms, 99)
    print(
        f"{name:<34} {rate:>10,.0f} {tally.calls / elapsed:>8.1f} {p50:>9.1f} {p99:>9.1f} "
        f"{tally.failed:>7} {ratio}",
        flush=True,
    )
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256], help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per reply")
    parser.add_argument("--body-kb", type=float, default=12.7, help="size of each agent request")
    parser.add_argument(
        "--pace-ms", type=float, default=0.0, help="upstream's wait between a stream's chunks"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each run")
    parser.add_argument(
        "--workers", type=int, default=1, help="also PostgreSQL behind `gateway serve --workers N`"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each target, the upstream directly and through the gateway in turn (median ratio)",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the upstream's own process
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.tokens, args.pace_ms))
        return 0

    work = Path(tempfile.mkdtemp(prefix="gateway-stream-bench-"))
    body = agent_body(args.body_kb, args.tokens)
    upstream, port = fake_vllm.start(
        work,
        "--tokens",
        str(args.tokens),
        "--pace-ms",
        str(args.pace_ms),
        script=__file__,
        name="streaming upstream",
    )
    print(
        f"{args.tokens} tokens a reply, {len(body) / 1024:.1f} KB requests, upstream pace {args.pace_ms} ms, "
        f"{args.seconds:.0f} s a run\n"
    )
    columns = ("tokens/s", "calls/s", "TTFT p50", "TTFT p99", "failed", "ratio")
    print(f"{'target':<34}", *(f"{c:>{w}}" for c, w in zip(columns, (10, 8, 9, 9, 7, 6), strict=True)))
    try:
        with postgres_schemas(1 if args.workers > 1 else 0) as urls:
            for concurrency in args.concurrency:
                targets = {
                    f"{concurrency} streams, gateway, SQLite": (f"sqlite:///{work / f'{concurrency}.db'}", [])
                }
                if args.workers > 1:
                    targets[f"{concurrency} streams, gateway, PG, {args.workers} w"] = (
                        urls[0],
                        ["--workers", str(args.workers)],
                    )
                with contextlib.ExitStack() as running:
                    gateways = {
                        name: running.enter_context(
                            GatewayProcess(
                                [f"http://127.0.0.1:{port}"],
                                db_url,
                                log_path=work / f"gateway-{concurrency}-{index}.log",
                                extra_args=extra,
                            )
                        )
                        for index, (name, (db_url, extra)) in enumerate(targets.items())
                    }
                    ratios: dict[str, list[float]] = {name: [] for name in gateways}
                    for _ in range(args.rounds):
                        floor = report(
                            f"{concurrency} streams, upstream directly",
                            *asyncio.run(load(port, False, body, concurrency, args.seconds)),
                            args.tokens,
                            None,
                        )
                        for name, gateway in gateways.items():
                            rate = report(
                                name,
                                *asyncio.run(load(gateway.port, True, body, concurrency, args.seconds)),
                                args.tokens,
                                floor,
                            )
                            ratios[name].append(rate / floor)
                if args.rounds > 1:
                    for name, values in ratios.items():
                        shown = ", ".join(f"{value:.2f}" for value in values)
                        print(f"{name}: median ratio {statistics.median(values):.2f} ({shown})", flush=True)
    finally:
        upstream.stop()
    print(f"\n(PostgreSQL: {POSTGRES_URL}; logs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
