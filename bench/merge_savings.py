"""Training tokens of merged samples against step-wise ones, for agent rollouts of 5, 10 and 20 turns.

    scripts/dev bench   (last of the benchmarks)

Each rollout starts from a 600-token prompt; every turn samples 120 tokens and the environment answers with
60 (a tool result), and the next prompt is exactly the previous prompt + completion + that answer: what the
gateway's exact mode sends. Step-wise training reprocesses the whole history at every turn (quadratic in
the number of turns); a merged sample holds it once.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.store.database import ensure_schema
from gateway.store.records import NewRollout, Reward, TurnRecord
from gateway.store.store import Store
from trainer_client import SampleOptions, TrainerClient

ROLLOUTS = 16
FIRST_PROMPT, COMPLETION, ENVIRONMENT = 600, 120, 60


async def fill(db_url: str, turns: int) -> None:
    rng = np.random.default_rng(turns)
    store = Store(db_url)
    for r in range(ROLLOUTS):
        rollout_id = f"r{r}"
        await store.create_rollout(NewRollout(rollout_id, group_id=f"g{r // 4}"))
        prompt = rng.integers(0, 2000, FIRST_PROMPT, dtype=np.int32)
        for _ in range(turns):
            completion = rng.integers(0, 2000, COMPLETION, dtype=np.int32)
            await store.writer.insert_turns(
                [
                    TurnRecord(
                        rollout_id,
                        "completions",
                        "tiny",
                        False,
                        "0",
                        time.time(),
                        prompt_ids=prompt,
                        completion_ids=completion,
                        completion_logprobs=np.full(COMPLETION, -1.0, dtype=np.float32),
                        finished_at=time.time(),
                    )
                ]
            )
            prompt = np.concatenate([prompt, completion, rng.integers(0, 2000, ENVIRONMENT, dtype=np.int32)])
        await store.finish_rollout(rollout_id, "completed", Reward(float(r % 2)))
    store.close()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="merge-bench-"))
    print(
        f"{ROLLOUTS} rollouts a row; prompt {FIRST_PROMPT}, completion {COMPLETION}, "
        f"tool result {ENVIRONMENT} tokens\n"
    )
    print(f"{'turns':>6} {'step-wise tokens':>17} {'merged tokens':>14} {'saved':>7} {'samples':>12}")
    for turns in (5, 10, 20):
        db_url = f"sqlite:///{work / f'{turns}.db'}"
        ensure_schema(db_url)
        asyncio.run(fill(db_url, turns))
        with TrainerClient(db_url) as client:
            steps = client.read().metrics()
            merged = client.read(SampleOptions(merged=True)).metrics()
        saved = 1 - merged["tokens"] / steps["tokens"]
        print(
            f"{turns:>6} {steps['tokens']:>17,.0f} {merged['tokens']:>14,.0f} {saved:>7.1%} "
            f"{steps['samples']:>5.0f} -> {merged['samples']:<4.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
