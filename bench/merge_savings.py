"""Training tokens of merged samples against step-wise ones, for agent rollouts of 5, 10 and 20 turns, and
for 10-turn rollouts that hand work to 0, 1 and 4 sub-agents.

    scripts/dev bench   (last of the benchmarks)

Each rollout starts from a 600-token prompt; every turn samples 120 tokens and the environment answers with
60 (a tool result), and the next prompt is exactly the previous prompt + completion + that answer: what the
gateway's exact mode sends. A sub-agent is a conversation of its own (a 400-token prompt, 3 calls), its calls
made between two turns of the main conversation, as Claude Code's Task tool makes them; several are handed
out at turns spread over the conversation (4 in 10 turns: after turns 0, 2, 5 and 7). Step-wise training
reprocesses the whole history at every turn (quadratic in the number of turns); a merged sample holds each
chain of the rollout's lineage tree once. `trained` counts the tokens with loss: every sampled token, once.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.store.records import NewRollout, Reward, TurnRecord
from gateway.store.store import Store
from rollout_store.database import ensure_schema
from trainer_client import SampleOptions, TrainerClient

ROLLOUTS = 16
FIRST_PROMPT, COMPLETION, ENVIRONMENT = 600, 120, 60
SUB_PROMPT, SUB_CALLS = 400, 3


class Conversation:
    """One chain of calls whose prompts extend each other exactly."""

    def __init__(self, rng: np.random.Generator, rollout_id: str, prompt: int) -> None:
        self.rng, self.rollout_id = rng, rollout_id
        self.prompt = rng.integers(0, 2000, prompt, dtype=np.int32)

    def call(self) -> TurnRecord:
        completion = self.rng.integers(0, 2000, COMPLETION, dtype=np.int32)
        record = TurnRecord(
            self.rollout_id,
            "completions",
            "tiny",
            False,
            "0",
            time.time(),
            prompt_ids=self.prompt,
            completion_ids=completion,
            completion_logprobs=np.full(COMPLETION, -1.0, dtype=np.float32),
            finished_at=time.time(),
        )
        tool_result = self.rng.integers(0, 2000, ENVIRONMENT, dtype=np.int32)
        self.prompt = np.concatenate([self.prompt, completion, tool_result])
        return record


async def fill(db_url: str, turns: int, sub_agents: int) -> None:
    rng = np.random.default_rng(turns * 10 + sub_agents)
    store = Store(db_url)
    for r in range(ROLLOUTS):
        rollout_id = f"r{r}"
        await store.create_rollout(NewRollout(rollout_id, group_id=f"g{r // 4}"))
        main = Conversation(rng, rollout_id, FIRST_PROMPT)
        handing_out = {k * turns // sub_agents for k in range(sub_agents)}  # spread over the conversation
        for turn in range(turns):
            await store.writer.insert_turns([main.call()])
            if turn in handing_out:
                sub = Conversation(rng, rollout_id, SUB_PROMPT)
                for _ in range(SUB_CALLS):
                    await store.writer.insert_turns([sub.call()])
        await store.finish_rollout(rollout_id, "completed", Reward(float(r % 2)))
    store.close()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="merge-bench-"))
    print(
        f"{ROLLOUTS} rollouts a row; prompt {FIRST_PROMPT}, completion {COMPLETION}, "
        f"tool result {ENVIRONMENT} tokens; a sub-agent: prompt {SUB_PROMPT}, {SUB_CALLS} calls\n"
    )
    print(
        f"{'turns':>6} {'sub-agents':>10} {'step-wise tokens':>17} {'merged tokens':>14} {'saved':>7} "
        f"{'trained':>9} {'samples':>12}"
    )
    for turns, sub_agents in ((5, 0), (10, 0), (20, 0), (10, 1), (10, 4)):
        db_url = f"sqlite:///{work / f'{turns}-{sub_agents}.db'}"
        ensure_schema(db_url)
        asyncio.run(fill(db_url, turns, sub_agents))
        with TrainerClient(db_url) as client:
            steps = client.read().metrics()
            merged = client.read(SampleOptions(merged=True)).metrics()
        saved = 1 - merged["tokens"] / steps["tokens"]
        sampled = ROLLOUTS * (turns + sub_agents * SUB_CALLS) * COMPLETION
        trained = (
            "all"
            if merged["loss_tokens"] == steps["loss_tokens"] == sampled
            else f"{merged['loss_tokens']:,.0f}"
        )
        print(
            f"{turns:>6} {sub_agents:>10} {steps['tokens']:>17,.0f} {merged['tokens']:>14,.0f} {saved:>7.1%} "
            f"{trained:>9} {steps['samples']:>5.0f} -> {merged['samples']:<4.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
