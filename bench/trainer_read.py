"""How fast trainers get tokens out of the store: 10k turns of 1k-4k tokens, from the database to padded
torch tensors, on SQLite and PostgreSQL.

    scripts/dev bench   (after the gateway overhead benchmark)

Rollouts of 5 turns (each prompt extends the previous turn, as agents' histories do, so the store holds
them delta-encoded), 8 rollouts a group. The store is filled through the gateway's own writer (no HTTP),
then read back with `TrainerClient.iter_batches` (32 groups a batch) and turned into padded tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.store.records import NewRollout, Reward, TurnRecord
from gateway.store.store import Store
from rollout_store.database import ensure_schema, make_engine
from trainer_client import TrainerClient

POSTGRES_URL = os.environ.get("GATEWAY_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
TURNS_PER_ROLLOUT = 5
GROUP_SIZE = 8


async def fill(db_url: str, turns: int, rng: np.random.Generator) -> None:
    store = Store(db_url)
    writer = store.writer
    rollouts = turns // TURNS_PER_ROLLOUT
    pending = []
    for r in range(rollouts):
        rollout_id = f"r{r}"
        await writer.create_rollout(NewRollout(rollout_id, group_id=f"g{r // GROUP_SIZE}"))
        first = int(rng.integers(1000, 2000))
        prompt = rng.integers(0, 2000, first, dtype=np.int32)
        for _ in range(TURNS_PER_ROLLOUT):
            completion = rng.integers(0, 2000, int(rng.integers(100, 300)), dtype=np.int32)
            record = TurnRecord(
                rollout_id,
                "chat",
                "tiny",
                False,
                "0",
                time.time(),
                messages=[],
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=-rng.random(completion.shape[0], dtype=np.float32),
                finished_at=time.time(),
            )
            pending.append(writer.enqueue_turns([record]))
            growth = rng.integers(0, 2000, int(rng.integers(50, 250)), dtype=np.int32)
            prompt = np.concatenate([prompt, completion, growth])[:3800]
        await asyncio.gather(*pending)
        pending.clear()
        await writer.finish_rollout(rollout_id, "completed", Reward(float(rng.random())))
    store.close()


def read(db_url: str) -> tuple[int, int, float, float]:
    client = TrainerClient(db_url)
    started = time.perf_counter()
    samples = tokens = 0
    tensor_seconds = 0.0
    for batch in client.iter_batches(groups_per_batch=32):
        tensors_started = time.perf_counter()
        padded = batch.padded()
        tensor_seconds += time.perf_counter() - tensors_started
        samples += len(batch)
        tokens += int(padded["attention_mask"].sum())
    elapsed = time.perf_counter() - started
    client.close()
    return samples, tokens, elapsed, tensor_seconds


def token_bytes(db_url: str) -> tuple[int, int]:
    """Bytes of ids and logprobs stored, and what storing every prompt in full would take."""
    engine = make_engine(db_url)
    with engine.connect() as conn:
        stored, full = conn.execute(
            sa.text(
                "SELECT SUM(LENGTH(prompt_ids) + LENGTH(completion_ids) + LENGTH(completion_logprobs)), "
                "SUM(4 * prompt_tokens + 8 * completion_tokens) FROM turns"
            )
        ).one()
    engine.dispose()
    return int(stored), int(full)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=10_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    schema = f"gw_bench_{uuid.uuid4().hex[:8]}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    stores = {
        "SQLite": f"sqlite:///{work / 'bench.db'}",
        "PostgreSQL": f"{POSTGRES_URL}?options=-csearch_path%3D{schema}",
    }
    print(f"{args.turns} turns, {TURNS_PER_ROLLOUT} per rollout, {GROUP_SIZE} rollouts per group\n")
    print(
        f"{'store':<12} {'fill s':>8} {'read s':>8} {'tensors s':>10} {'samples':>8} {'Mtokens':>8} "
        f"{'Mtok/s':>8} {'stored MB':>10} {'undelta MB':>10}"
    )
    try:
        for name, db_url in stores.items():
            ensure_schema(db_url)
            started = time.perf_counter()
            asyncio.run(fill(db_url, args.turns, np.random.default_rng(0)))
            filled = time.perf_counter() - started
            samples, tokens, elapsed, tensor_seconds = read(db_url)
            stored, full = token_bytes(db_url)
            print(
                f"{name:<12} {filled:>8.1f} {elapsed:>8.2f} {tensor_seconds:>10.2f} {samples:>8} "
                f"{tokens / 1e6:>8.2f} {tokens / elapsed / 1e6:>8.2f} {stored / 1e6:>10.1f} "
                f"{full / 1e6:>10.1f}"
            )
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
