"""The tail of a call's latency through the gateway: many sequential agent calls against an instant upstream,
each turn committed before its reply, on SQLite and on PostgreSQL.

    python bench/commit_tail.py [--calls 20000] [--store sqlite|postgresql|both]

The median says what a call costs; the 99.9th percentile and the maximum say whether a call ever waits on
something else (a WAL checkpoint, a lock, the event loop, a garbage collection). The upstream
(bench/fake_vllm.py) answers instantly with the shape vLLM sends (3.2k prompt ids, 64 sampled ids and their
logprobs); calls go in rollouts of 20 turns on one keep-alive connection. The slowest calls are listed with
their position in the run, so a stall that recurs shows its cadence.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import fake_vllm
import numpy as np
from gateway_overhead import Client, agent_body, paths_for, postgres_schemas

from testbed.launcher import GatewayProcess

TARGET_P999_MS, TARGET_MAX_MS = 10.0, 25.0


async def timed_calls(port: int, calls: int, warmup: int = 200) -> np.ndarray:
    """Milliseconds of each call after `warmup` ones, in order; progress on stderr."""
    gc.freeze()  # the measuring client's own collections are not the gateway's
    gc.disable()
    client = Client("127.0.0.1", port)
    await client.connect()
    body, paths = agent_body(), paths_for("gateway")
    samples = np.empty(calls, dtype=np.float64)
    for i in range(-warmup, calls):
        started = time.perf_counter()
        status = await client.post(next(paths), body)
        if status != 200:
            raise RuntimeError(f"call {i} answered HTTP {status}")
        if i >= 0:
            samples[i] = (time.perf_counter() - started) * 1000
            if (i + 1) % 2000 == 0:
                print(f"  {i + 1}/{calls} calls", file=sys.stderr, flush=True)
    client.writer.close()
    gc.enable()
    return samples


def report(name: str, samples: np.ndarray) -> None:
    p50, p99, p999 = np.percentile(samples, [50, 99, 99.9])
    worst = samples.max()
    met = p999 <= TARGET_P999_MS and worst <= TARGET_MAX_MS
    print(
        f"{name:<12} {p50:>7.2f} {p99:>7.2f} {p999:>8.2f} {worst:>8.2f}   "
        f"{'met' if met else 'MISSED'} (p99.9 <= {TARGET_P999_MS:g} ms, max <= {TARGET_MAX_MS:g} ms)"
    )
    slowest = np.argsort(samples)[-8:][::-1]
    print("             slowest: " + ", ".join(f"#{i} {samples[i]:.1f} ms" for i in sorted(slowest)))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20_000, help="sequential agent calls per store")
    parser.add_argument("--store", choices=["sqlite", "postgresql", "both"], default="both")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gateway-tail-"))
    upstream, upstream_port = fake_vllm.start(work)
    print(f"{args.calls} sequential agent calls per store, rollouts of 20 turns, every turn committed\n")
    print(f"{'store':<12} {'p50 ms':>7} {'p99 ms':>7} {'p99.9 ms':>8} {'max ms':>8}")
    try:
        for store in ("sqlite", "postgresql"):
            if args.store not in (store, "both"):
                continue
            with ExitStack() as stack:
                if store == "sqlite":
                    db_url = f"sqlite:///{work / 'tail.db'}"
                else:
                    (db_url,) = stack.enter_context(postgres_schemas(1))
                with GatewayProcess(
                    [f"http://127.0.0.1:{upstream_port}"], db_url, log_path=work / f"gateway-{store}.log"
                ) as gw:
                    samples = asyncio.run(timed_calls(gw.port, args.calls))
            report(store, samples)
    finally:
        upstream.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
