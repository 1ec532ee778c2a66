"""One gateway on several replicas sharing a PostgreSQL store: how long an admin change takes to reach every
replica, and how many agent calls two replicas take against one.

    scripts/dev python bench/fleet_sync.py [--changes 100] [--replicas 2] [--seconds 10] [--connections 32]

Changes: `--changes` policy versions set in turn through each replica; for each, the time the admin call
took (it returns once every live replica holds the change) and the time until another replica's /healthz
first reports it (polled from the moment the call was sent). Throughput: the agent-call load of
bench/gateway_overhead.py against one replica, then split over two, on the fake upstream
(bench/fake_vllm.py); all processes share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import fake_vllm
import httpx
from gateway_overhead import agent_body, postgres_schemas, throughput

from testbed.launcher import GatewayProcess


async def one_change(replicas: list[GatewayProcess], through: int, version: str) -> tuple[float, float]:
    """(seconds the admin call took, seconds until the next replica reported the version)."""
    other = replicas[(through + 1) % len(replicas)]
    async with httpx.AsyncClient(timeout=30) as client:

        async def seen() -> float:
            while (await client.get(f"{other.url}/healthz")).json()["policy_version"] != version:
                pass
            return time.perf_counter()

        started = time.perf_counter()
        watch = asyncio.create_task(seen())
        answer = await client.post(f"{replicas[through].url}/admin/policy_version", json={"version": version})
        answer.raise_for_status()
        returned = time.perf_counter()
        return returned - started, await watch - started


def changes(replicas: list[GatewayProcess], count: int) -> tuple[list[float], list[float]]:
    calls, applied = [], []
    for i in range(count):
        took, seen = asyncio.run(one_change(replicas, i % len(replicas), f"v{i}"))
        calls.append(took * 1000)
        applied.append(seen * 1000)
    return calls, applied


async def spread(ports: list[int], connections: int, seconds: float) -> float:
    """Calls per second with the connections split over the replicas."""
    body = agent_body()
    share = connections // len(ports)
    rates = await asyncio.gather(*(throughput(port, "gateway", body, share, seconds) for port in ports))
    return sum(rates)


def summary(name: str, samples: list[float]) -> str:
    return f"{name:<44} p50 {statistics.median(samples):7.1f} ms   max {max(samples):7.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--changes", type=int, default=100, help="policy versions set, in turn through each")
    parser.add_argument("--replicas", type=int, default=2, help="gateway replicas for the changes")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each throughput run")
    parser.add_argument("--connections", type=int, default=32, help="concurrent agent connections in all")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    upstream, port = fake_vllm.start(work)
    backend = [f"http://127.0.0.1:{port}"]
    try:
        with postgres_schemas(2) as (changes_db, load_db):
            replicas = [
                GatewayProcess(backend, changes_db, log_path=work / f"replica-{i}.log").start()
                for i in range(args.replicas)
            ]
            try:
                calls, applied = changes(replicas, args.changes)
            finally:
                for replica in replicas:
                    replica.stop()
            print(f"{args.changes} policy versions set through {args.replicas} replicas in turn:")
            print(summary("  the admin call (every replica holds it)", calls))
            print(summary("  until the next replica reports it", applied))

            rates = []
            for count in (1, 2):
                replicas = [
                    GatewayProcess(backend, load_db, log_path=work / f"load-{i}.log").start()
                    for i in range(count)
                ]
                try:
                    rates.append(
                        asyncio.run(spread([r.port for r in replicas], args.connections, args.seconds))
                    )
                finally:
                    for replica in replicas:
                        replica.stop()
            print(
                f"agent calls, {args.connections} connections x {args.seconds:.0f} s, PostgreSQL: one "
                f"replica {rates[0]:.0f}/s, two {rates[1]:.0f}/s ({rates[1] / rates[0]:.2f}x)"
            )
    finally:
        upstream.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
