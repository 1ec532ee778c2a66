"""What the gateway costs per model call: latency and throughput against a vLLM-shaped upstream, direct vs.
through the gateway (SQLite and PostgreSQL stores), every turn durably committed.

    scripts/dev bench [--seconds 10] [--connections 32] [--workers 2]
    python bench/gateway_overhead.py --against 703d98a   # HEAD against that commit, in one sitting
    python bench/gateway_overhead.py --load wrk          # the load from wrk (4.1), not the bench's client

The upstream (bench/fake_vllm.py) answers instantly with canned bytes of the shape vLLM sends with
`return_token_ids` and `logprobs` (3.2k prompt ids, 64 sampled ids), so the differences are the gateway's.
The agent request is a 12.7 KB chat body. Each connection calls in rollouts of 20 turns (each turn stores
its full prompt: the canned ids do not chain), the first call of each creating and pinning its rollout.
The load generator is a raw-socket HTTP/1.1 client in Python, or wrk with `--load wrk` (one thread per
connection, so that each connection keeps its own rollouts); all three processes share this machine's cores.
With `--workers N` (N > 1) the PostgreSQL store is also measured behind `gateway serve --workers N`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import builds
import fake_vllm
import orjson
import sqlalchemy as sa

from rollout_store.database import make_engine
from testbed.launcher import GatewayProcess

POSTGRES_URL = os.environ.get("GATEWAY_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def agent_body() -> bytes:
    words = " ".join(f"word{i % 97}" for i in range(1500))
    messages = [
        {"role": "system", "content": "You are a coding agent. " + words[:4000]},
        {"role": "user", "content": words[:8600]},
    ]
    return orjson.dumps({"model": "tiny", "messages": messages, "max_tokens": 64, "temperature": 1.0})


class Client:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, body: bytes) -> int:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await self.reader.readexactly(length)
        return int(status_line.split()[1])


TURNS_PER_ROLLOUT = 20


def paths_for(target: str) -> Iterator[str]:
    """One connection's request paths: through the gateway, a new rollout every 20 calls."""
    while True:
        path = (
            "/v1/chat/completions"
            if target == "direct"
            else f"/rollouts/{uuid.uuid4().hex}/v1/chat/completions"
        )
        for _ in range(TURNS_PER_ROLLOUT):
            yield path


async def latency(port: int, target: str, body: bytes, requests: int) -> list[float]:
    client = Client("127.0.0.1", port)
    await client.connect()
    samples = []
    paths = paths_for(target)
    for i in range(requests + 50):
        started = time.perf_counter()
        status = await client.post(next(paths), body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        if i >= 50:  # warm-up
            samples.append((time.perf_counter() - started) * 1000)
    client.writer.close()
    return samples


async def throughput(port: int, target: str, body: bytes, connections: int, seconds: float) -> float:
    clients = [Client("127.0.0.1", port) for _ in range(connections)]
    await asyncio.gather(*(c.connect() for c in clients))
    done = 0
    deadline = time.perf_counter() + seconds

    async def loop(client: Client) -> None:
        nonlocal done
        paths = paths_for(target)
        while time.perf_counter() < deadline:
            if await client.post(next(paths), body) != 200:
                raise RuntimeError("request failed")
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in clients))
    elapsed = time.perf_counter() - started
    for c in clients:
        c.writer.close()
    return done / elapsed


WRK_SCRIPT = """
local made = 0
function setup(thread)
  made = made + 1
  thread:set("prefix", string.format("wrk%s-%d", os.time(), made))
end
function init(args)
  local file = io.open(args[1], "rb")
  wrk.method, wrk.body = "POST", file:read("*a")
  file:close()
  wrk.headers["content-type"] = "application/json"
  target, turns, calls = args[2], tonumber(args[3]), 0
end
function request()
  calls = calls + 1
  if target == "direct" then return wrk.format(nil, "/v1/chat/completions") end
  local rollout = string.format("%s-%d", prefix, math.floor(calls / turns))
  return wrk.format(nil, "/rollouts/" .. rollout .. "/v1/chat/completions")
end
"""
"""Each wrk thread (one connection) calls in rollouts of `TURNS_PER_ROLLOUT` turns, as the bench's client
does (LuaJIT: Lua 5.1)."""
WRK_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def wrk(port: int, target: str, body: bytes, connections: int, seconds: float) -> tuple[float, float, float]:
    """p50 ms, p99 ms and req/s of one wrk run; any non-2xx reply fails the run."""
    duration = f"-d{max(1, round(seconds))}s"  # whole seconds only
    with tempfile.TemporaryDirectory(prefix="wrk-") as directory:
        work = Path(directory)
        (work / "body.json").write_bytes(body)
        (work / "calls.lua").write_text(WRK_SCRIPT)
        command = ["wrk", f"-t{connections}", f"-c{connections}", duration, "--latency", "-s"]
        command += [str(work / "calls.lua"), f"http://127.0.0.1:{port}", "--", str(work / "body.json")]
        command += [target, str(TURNS_PER_ROLLOUT)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw failed calls:\n{out}")
    percentile = {
        int(share): float(value) * WRK_UNITS[unit]
        for share, value, unit in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)$", out, re.MULTILINE)
    }
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1])  # type: ignore[index]
    return percentile[50], percentile[99], rate


def measure(port: int, target: str, args: argparse.Namespace) -> tuple[float, float, float]:
    body = agent_body()
    if args.load == "wrk":
        p50, p99, _ = wrk(port, target, body, 1, args.seconds)
        return p50, p99, wrk(port, target, body, args.connections, args.seconds)[2]
    samples = asyncio.run(latency(port, target, body, args.requests))
    rate = asyncio.run(throughput(port, target, body, args.connections, args.seconds))
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)], rate


def stored_bytes_per_turn(db_url: str) -> float:
    engine = make_engine(db_url)
    with engine.connect() as conn:
        turns, blob = conn.execute(
            sa.text(
                "SELECT COUNT(*), "
                "SUM(LENGTH(prompt_ids) + LENGTH(completion_ids) + LENGTH(completion_logprobs)) FROM turns"
            )
        ).one()
    engine.dispose()
    return blob / max(turns, 1)


@contextmanager
def postgres_schemas(count: int) -> Iterator[list[str]]:
    """URLs of `count` fresh schemas of the benchmark's PostgreSQL database, dropped afterwards."""
    schemas = [f"gw_bench_{uuid.uuid4().hex[:8]}" for _ in range(count)]
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        for schema in schemas:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield [f"{POSTGRES_URL}?options=-csearch_path%3D{schema}" for schema in schemas]
    finally:
        with admin.begin() as conn:
            for schema in schemas:
                conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


Row = tuple[float, float, float]
"""p50 ms, p99 ms, req/s."""


def stores_of(urls: list[str], work: Path, workers: int) -> dict[str, tuple[str, list[str]]]:
    """The stores measured, by name: their URL and the gateway's extra flags."""
    stores = {"gateway, SQLite": (f"sqlite:///{work / f'bench-{uuid.uuid4().hex[:8]}.db'}", [])}
    stores["gateway, PostgreSQL"] = (urls[0], [])
    if workers > 1:
        stores[f"gateway, PostgreSQL, {workers} workers"] = (urls[1], ["--workers", str(workers)])
    return stores


def through_gateway(
    upstream_port: int,
    db_url: str,
    extra: list[str],
    work: Path,
    args: argparse.Namespace,
    env: dict[str, str] | None,
) -> Row:
    with GatewayProcess(
        [f"http://127.0.0.1:{upstream_port}"],
        db_url,
        log_path=work / "gateway.log",
        extra_args=extra,
        env=env,
    ) as gw:
        return measure(gw.port, "gateway", args)


def print_row(name: str, row: Row, floor: Row, note: str = "") -> None:
    p50, p99, rate = row
    print(
        f"{name:<31} {p50:>8.2f} {p99:>8.2f} {rate:>8.0f} {p50 - floor[0]:>+9.2f}  "
        f"{rate / floor[2]:>8.1%}   {note}"
    )


def single(upstream_port: int, floor: Row, work: Path, args: argparse.Namespace) -> None:
    """The checkout's gateway on each store."""
    with postgres_schemas(2 if args.workers > 1 else 1) as urls:
        for name, (db_url, extra) in stores_of(urls, work, args.workers).items():
            row = through_gateway(upstream_port, db_url, extra, work, args, None)
            print_row(name, row, floor, f"({stored_bytes_per_turn(db_url) / 1024:.1f} KB of ids per turn)")


def compared(upstream_port: int, floor: Row, work: Path, args: argparse.Namespace) -> None:
    """HEAD against `--against`, each from its own wheel, alternating, each run on a fresh store; then each
    version's median and their ratio."""
    versions = {ref: builds.environment(builds.installed(ref, work)) for ref in ("HEAD", args.against)}
    rows: dict[tuple[str, str], list[Row]] = {}
    for round_ in range(args.rounds):
        with postgres_schemas(2 * (2 if args.workers > 1 else 1)) as urls:
            for index, (ref, env) in enumerate(versions.items()):
                mine = urls[index::2]
                for name, (db_url, extra) in stores_of(mine, work, args.workers).items():
                    row = through_gateway(upstream_port, db_url, extra, work, args, env)
                    rows.setdefault((name, ref), []).append(row)
                    print_row(f"{name}, {ref}"[:31], row, floor, f"(run {round_ + 1})")
    print(f"\nmedians of {args.rounds} runs; ratio: HEAD's req/s over {args.against}'s, and p50's")
    for name in dict.fromkeys(name for name, _ in rows):
        head, old = (median_row(rows[name, ref]) for ref in versions)
        for ref, row in zip(versions, (head, old), strict=True):
            print_row(f"{name}, {ref}"[:31], row, floor)
        print(f"{'':<31} req/s x{head[2] / old[2]:.3f}, p50 x{head[0] / old[0]:.3f}")


def median_row(rows: list[Row]) -> Row:
    p50, p99, rate = zip(*rows, strict=True)
    return statistics.median(p50), statistics.median(p99), statistics.median(rate)


def load_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `measure`: how long, how wide, and what makes the load."""
    parser.add_argument("--requests", type=int, default=1000, help="sequential requests for the latency run")
    parser.add_argument("--connections", type=int, default=32, help="concurrent connections for throughput")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each throughput run")
    parser.add_argument(
        "--load",
        choices=("client", "wrk"),
        default="client",
        help="the load generator: the bench's own Python client, or wrk (latency at one connection for "
        "--seconds instead of --requests calls)",
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    load_arguments(parser)
    parser.add_argument(
        "--workers", type=int, default=1, help="also measure PostgreSQL behind `gateway serve --workers N`"
    )
    parser.add_argument(
        "--against",
        metavar="COMMIT",
        help="compare HEAD with this commit, each run from the wheel built from its own tree, alternating",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --against: runs of each version")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    upstream, upstream_port = fake_vllm.start(work)
    sequential = f"{args.seconds:.0f} s" if args.load == "wrk" else f"{args.requests} sequential requests"
    print(
        f"agent request {len(agent_body()) / 1024:.1f} KB ({args.load}); {sequential} for latency, "
        f"{args.connections} connections x {args.seconds:.0f} s for throughput\n"
    )
    print(f"{'target':<31} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'added p50':>10} {'of floor':>9}")
    try:
        floor = measure(upstream_port, "direct", args)
        print(f"{'upstream directly':<31} {floor[0]:>8.2f} {floor[1]:>8.2f} {floor[2]:>8.0f}")
        (compared if args.against else single)(upstream_port, floor, work, args)
    finally:
        upstream.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
