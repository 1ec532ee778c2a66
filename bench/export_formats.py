"""What `trainer-client export` costs per format: rows per second and bytes per token written, jsonl, parquet
and a Hugging Face dataset (`--format hf`), from the same SQLite store of 10k turns of 1k-4k tokens (the
store of bench/trainer_read.py), step-wise samples.

    scripts/dev python bench/export_formats.py [--turns 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from trainer_read import fill

from rollout_store.database import ensure_schema
from trainer_client import TrainerClient


def size(path: Path) -> int:
    return (
        path.stat().st_size
        if path.is_file()
        else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=10_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="export-bench-"))
    db_url = f"sqlite:///{work / 'bench.db'}"
    ensure_schema(db_url)
    asyncio.run(fill(db_url, args.turns, np.random.default_rng(0)))
    with TrainerClient(db_url) as client:
        tokens = sum(len(s.input_ids) for batch in client.iter_batches() for s in batch.samples)
    print(f"{args.turns} turns, {tokens / 1e6:.1f} M tokens (prompt + completion, every sample)\n")
    print(f"{'format':<8} {'seconds':>8} {'rows/s':>8} {'MB':>8} {'bytes/token':>12}")
    for fmt, name in (("jsonl", "samples.jsonl"), ("parquet", "samples.parquet"), ("hf", "samples")):
        output = work / name
        command = [sys.executable, "-m", "trainer_client.cli", "export", "--db", db_url, "--format", fmt]
        started = time.perf_counter()
        subprocess.run([*command, "-o", str(output)], check=True, capture_output=True)
        seconds = time.perf_counter() - started
        written = size(output)
        print(
            f"{fmt:<8} {seconds:>8.1f} {args.turns / seconds:>8.0f} {written / 1e6:>8.1f} "
            f"{written / tokens:>12.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
