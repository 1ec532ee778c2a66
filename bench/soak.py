"""Load and soak: many concurrent agent sessions for minutes, against a vLLM-shaped upstream that answers
instantly (bench/fake_vllm.py), on SQLite and PostgreSQL.

    scripts/dev shell -c 'python bench/soak.py --minutes 10 --sessions 500 --turns 20'

Each session creates a rollout, makes `--turns` chat calls of a growing conversation (each request sends the
history back with the previous reply, as agents do), finishes the rollout with a reward, and starts over,
until the time is up. Reported per store: errors (must be 0), turns answered against turns stored (must be
equal), p50/p99 latency per call, calls per second, and the gateway's resident memory at the start, the
middle and the end of the run (must stay flat).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import fake_vllm
import orjson
import sqlalchemy as sa

from gateway.store.database import make_engine
from testbed.launcher import GatewayProcess

POSTGRES_URL = os.environ.get("GATEWAY_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
SYSTEM = "You are a coding agent. " + " ".join(f"word{i % 97}" for i in range(1400))
REPLY = {"role": "assistant", "content": "x" * 200}  # what the upstream answers, sent back by the agent


@dataclass
class Tally:
    answered: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)


class Connection:
    """One keep-alive HTTP/1.1 connection (a raw client: the load generator shares the machine)."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return status, await self.reader.readexactly(length)


async def session(port: int, turns: int, deadline: float, tally: Tally) -> None:
    connection = Connection(port)
    await connection.open()
    while time.monotonic() < deadline:
        status, created = await connection.post("/rollouts", orjson.dumps({"group_id": uuid.uuid4().hex[:8]}))
        if status != 201:
            tally.errors += 1
            continue
        rollout = orjson.loads(created)["rollout_id"]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the bug."}]
        for _ in range(turns):
            body = orjson.dumps({"model": "tiny", "messages": messages, "max_tokens": 64})
            started = time.perf_counter()
            status, _ = await connection.post(f"/rollouts/{rollout}/v1/chat/completions", body)
            tally.latencies.append((time.perf_counter() - started) * 1000)
            if status == 200:
                tally.answered += 1
            else:
                tally.errors += 1
            messages = [*messages, REPLY, {"role": "user", "content": "Continue."}]
        status, _ = await connection.post(f"/rollouts/{rollout}/finish", b'{"reward": 1.0}')
        tally.errors += status != 200
    connection.writer.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(gateway: GatewayProcess, args: argparse.Namespace) -> tuple[Tally, list[float]]:
    tally = Tally()
    seconds = args.minutes * 60
    deadline = time.monotonic() + seconds
    memory = [rss_mb(gateway.pid)]
    sessions = [
        asyncio.create_task(session(gateway.port, args.turns, deadline, tally)) for _ in range(args.sessions)
    ]
    started = time.monotonic()
    middle_taken = False
    while not all(task.done() for task in sessions):
        await asyncio.sleep(min(15.0, seconds / 4))
        elapsed = time.monotonic() - started
        if not middle_taken and elapsed >= seconds / 2:
            memory.append(rss_mb(gateway.pid))
            middle_taken = True
        print(
            f"  {elapsed:5.0f} s: {tally.answered} calls answered, {tally.errors} errors, "
            f"gateway {rss_mb(gateway.pid):.0f} MB",
            flush=True,
        )
    await asyncio.gather(*sessions)
    memory.append(rss_mb(gateway.pid))
    return tally, memory


def stored_ok_turns(db_url: str) -> int:
    engine = make_engine(db_url)
    with engine.connect() as conn:
        count = conn.execute(sa.text("SELECT COUNT(*) FROM turns WHERE status = 'ok'")).scalar_one()
    engine.dispose()
    return int(count)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="duration of each run (default: %(default)s)"
    )
    parser.add_argument(
        "--sessions", type=int, default=500, help="concurrent agent sessions (default: %(default)s)"
    )
    parser.add_argument("--turns", type=int, default=20, help="calls per rollout (default: %(default)s)")
    parser.add_argument("--store", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gateway-soak-"))
    upstream, upstream_port = fake_vllm.start(work)
    stores = {}
    if args.store in ("sqlite", "both"):
        stores["SQLite"] = f"sqlite:///{work / 'soak.db'}"
    admin = make_engine(POSTGRES_URL)
    schema = f"gw_soak_{uuid.uuid4().hex[:8]}"
    if args.store in ("postgresql", "both"):
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        stores["PostgreSQL"] = f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    print(f"{args.sessions} sessions x {args.turns} turns a rollout, {args.minutes:g} min per store\n")
    results = []
    try:
        for name, db_url in stores.items():
            print(f"{name}:")
            flags = ["--max-connections", str(args.sessions)]
            with GatewayProcess(
                [f"http://127.0.0.1:{upstream_port}"], db_url, log_path=work / f"{name}.log", extra_args=flags
            ) as gateway:
                tally, memory = asyncio.run(soak(gateway, args))
            stored = stored_ok_turns(db_url)
            latencies = sorted(tally.latencies)
            rate = tally.answered / (args.minutes * 60)
            results.append(
                (
                    name,
                    tally,
                    stored,
                    statistics.median(latencies),
                    latencies[int(len(latencies) * 0.99)],
                    rate,
                    memory,
                )
            )
    finally:
        upstream.stop()
        if args.store in ("postgresql", "both"):
            with admin.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        admin.dispose()

    print(
        f"\n{'store':<11} {'errors':>6} {'answered':>9} {'stored':>9} {'p50 ms':>7} {'p99 ms':>8} "
        f"{'calls/s':>8}  gateway RSS MB (start, middle, end)"
    )
    for name, tally, stored, p50, p99, rate, memory in results:
        print(
            f"{name:<11} {tally.errors:>6} {tally.answered:>9} {stored:>9} {p50:>7.1f} {p99:>8.1f} "
            f"{rate:>8.0f}  " + ", ".join(f"{m:.0f}" for m in memory)
        )
    failed = any(tally.errors or stored != tally.answered for _, tally, stored, *_ in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
