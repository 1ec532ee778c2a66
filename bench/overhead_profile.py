"""Where the gateway's time goes per model call, on the harness of `bench/gateway_overhead.py` (same upstream,
same request, rollouts of 20 calls): the gateway's CPU per call by thread (the event loop, the store
writer), its context switches per call, and, with `--py-spy`, a sampled profile grouped by component.

    python bench/overhead_profile.py [--store sqlite|postgresql] [--connections 1] [--requests 3000]
    python bench/overhead_profile.py --dialect messages   # the same call in Anthropic's Messages dialect
    python bench/overhead_profile.py --py-spy profile.txt   # needs `pip install py-spy` (not a dependency)

CPU time is read from /proc (Linux), so it is not inflated by other processes' load the way wall time is.
py-spy samples the thread holding the GIL (`--gil`): time in C code and system calls is charged to the Python
function that made the call.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fake_vllm
import orjson
import sqlalchemy as sa
from gateway_overhead import POSTGRES_URL, TURNS_PER_ROLLOUT, Client, agent_body

from rollout_store.database import make_engine
from testbed.launcher import GatewayProcess

COMPONENTS = [  # (component, path fragments of the sampled leaf frame), the first match wins
    ("capture: reply parsing, ids", ["gateway/turns/capture"]),
    (
        "store: SQL, lineage, commit, hand-offs to the writer",
        ["gateway/store/", "rollout_store/", "sqlalchemy/", "psycopg/", "sqlite3"],
    ),
    (
        "backend client (aiohttp)",
        ["aiohttp/", "gateway/fleet/engine", "gateway/turns/upstream", "multidict/", "yarl/"],
    ),
    ("HTTP server (uvicorn)", ["uvicorn/"]),
    ("framework (starlette, fastapi)", ["starlette/", "fastapi/", "contextlib"]),
    (
        "request reading, validation, translation",
        ["gateway/turns/intake", "gateway/openai/", "gateway/anthropic/", "pydantic/"],
    ),
    (
        "forwarding, recording, metrics",
        ["gateway/turns/", "gateway/metrics", "prometheus_client/", "dataclasses"],
    ),
    ("event loop (asyncio)", ["asyncio/", "threading", "queue"]),
]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread id and name."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        found[tid] = (int(fields[11]) + int(fields[12])) / ticks
    return found


def switches(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches of all threads of `pid`."""
    voluntary = involuntary = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


def messages_body() -> bytes:
    """The chat request of `bench/gateway_overhead.py` as Anthropic's Messages sends it: the gateway
    translates it to that chat request, and the reply back."""
    chat = orjson.loads(agent_body())
    system, *messages = chat.pop("messages")
    return orjson.dumps({**chat, "system": system["content"], "messages": messages})


DIALECTS = {"chat": ("chat/completions", agent_body), "messages": ("messages", messages_body)}
"""Each dialect's endpoint under a rollout's `/v1`, and its request body."""


def paths_for(endpoint: str) -> Iterator[str]:
    """One connection's request paths: a new rollout every `TURNS_PER_ROLLOUT` calls."""
    while True:
        path = f"/rollouts/{uuid.uuid4().hex}/v1/{endpoint}"
        for _ in range(TURNS_PER_ROLLOUT):
            yield path


async def run(port: int, endpoint: str, body: bytes, connections: int, requests: int) -> list[float]:
    """`requests` calls spread over `connections` connections; each call's latency in ms."""
    clients = [Client("127.0.0.1", port) for _ in range(connections)]
    await asyncio.gather(*(c.connect() for c in clients))
    latencies: list[float] = []

    async def loop(client: Client, count: int) -> None:
        paths = paths_for(endpoint)
        for _ in range(count):
            started = time.perf_counter()
            if await client.post(next(paths), body) != 200:
                raise RuntimeError("request failed")
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(loop(c, requests // connections) for c in clients))
    for c in clients:
        c.writer.close()
    return latencies


def components(raw: Path) -> list[tuple[str, float]]:
    """py-spy's raw samples (`stack;frames count` per line) as shares of the sampled time per component."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        name = next(
            (name for name, parts in COMPONENTS if any(part in leaf for part in parts)), "other (Python)"
        )
        counts[name] += int(count)
    total = sum(counts.values()) or 1
    return [(name, count / total) for name, count in counts.most_common()]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--dialect", choices=sorted(DIALECTS), default="chat")
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument(
        "--py-spy", type=Path, default=None, help="record a py-spy profile there (raw format)"
    )
    args = parser.parse_args()
    if args.py_spy is not None and shutil.which("py-spy") is None:
        parser.error("--py-spy needs py-spy on PATH: pip install py-spy")

    work = Path(tempfile.mkdtemp(prefix="gateway-profile-"))
    upstream, upstream_port = fake_vllm.start(work)
    schema = f"gw_profile_{uuid.uuid4().hex[:8]}"
    admin = make_engine(POSTGRES_URL) if args.store == "postgresql" else None
    if admin is not None:
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    db_url = (
        f"{POSTGRES_URL}?options=-csearch_path%3D{schema}" if admin is not None else f"sqlite:///{work}/p.db"
    )
    endpoint, make_body = DIALECTS[args.dialect]
    body = make_body()
    try:
        with GatewayProcess([f"http://127.0.0.1:{upstream_port}"], db_url, log_path=work / "gw.log") as gw:
            gateway_pid = gw.pid
            asyncio.run(run(gw.port, endpoint, body, 1, 200))  # warm-up
            spy = None
            if args.py_spy is not None:
                command = [
                    "py-spy",
                    "record",
                    "--pid",
                    str(gw.pid),
                    "-o",
                    str(args.py_spy),
                    "-f",
                    "raw",
                    "--nonblocking",
                ]
                spy = subprocess.Popen([*command, "--gil", "-r", "500"], stdout=subprocess.DEVNULL)
                time.sleep(1.0)
            cpu_before, switches_before = thread_cpu(gw.pid), switches(gw.pid)
            started = time.perf_counter()
            latencies = asyncio.run(run(gw.port, endpoint, body, args.connections, args.requests))
            elapsed = time.perf_counter() - started
            cpu_after, switches_after = thread_cpu(gw.pid), switches(gw.pid)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
    finally:
        upstream.stop()
        if admin is not None:
            with admin.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
            admin.dispose()

    calls = len(latencies)
    per_call = {t: (cpu_after[t] - cpu_before.get(t, 0.0)) * 1000 / calls for t in cpu_after}
    loop_cpu = per_call.pop(str(gateway_pid))  # the main thread runs the event loop
    others = sorted(per_call.values(), reverse=True)  # the busiest other thread is the store writer
    voluntary = (switches_after[0] - switches_before[0]) / calls
    involuntary = (switches_after[1] - switches_before[1]) / calls
    print(
        f"{args.dialect}, {args.store}, {args.connections} connection(s), {calls} calls, "
        f"load {os.getloadavg()[0]:.1f}: p50 {statistics.median(latencies):.2f} ms, "
        f"{calls / elapsed:.0f} calls/s"
    )
    print(
        f"gateway CPU per call {loop_cpu + sum(others):.3f} ms: event loop {loop_cpu:.3f}, store writer "
        f"{others[0]:.3f}, other threads {sum(others[1:]):.3f}; context switches per call "
        f"{voluntary:.1f} voluntary, {involuntary:.1f} involuntary"
    )
    if args.py_spy is not None:
        print("sampled time holding the GIL, by component:")
        for name, share in components(args.py_spy):
            print(f"  {share:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
