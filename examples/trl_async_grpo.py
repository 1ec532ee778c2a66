"""TRL's experimental `AsyncGRPOTrainer` fed by the gateway: environments keep playing GRPO groups through
the control API (`examples/environment.py`, or any orchestrator) while the trainer trains on the groups that
are ready, claimed from the store with their advantages, and vLLM takes each step's weights through the
gateway's admin API.

    python examples/trl_async_grpo.py --gateway http://127.0.0.1:8100 --db sqlite:///gateway.db \
        --model-dir path/to/policy --steps 1000

`GatewayRolloutWorker` claims ready groups (no other trainer gets them) and queues every chain of each rollout
as a sample with the rollout's advantage; groups more than `--max-staleness` policy versions behind the
trainer are skipped. `GatewayWeightTransfer` writes the weights TRL streams into `--model-dir` (the directory
vLLM serves) and has every vLLM behind the gateway reload them, then resumes at the next policy version
(vLLM needs VLLM_SERVER_DEV_MODE=1). The trainer's packed attention runs FlashAttention-3 kernels, so it
needs CUDA: `--cpu` trains in float32 on the CPU, with an attention of your own registered as `tree_fa3`
(tests/engine/test_trl.py registers one written with torch's SDPA). Needs the `trl` extra.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo import (  # type: ignore[attr-defined]  # exported lazily
    AsyncGRPOConfig,
    AsyncGRPOTrainer,
)

from trainer_client.trl import GatewayRolloutWorker, GatewayWeightTransfer


def build_worker(args: argparse.Namespace) -> GatewayRolloutWorker:
    """What feeds the trainer: ready groups claimed from the store, as TRL's rollout samples."""
    return GatewayRolloutWorker(
        args.db, max_staleness=args.max_staleness, groups_per_claim=args.groups_per_claim
    )


def build_trainer(args: argparse.Namespace, worker: GatewayRolloutWorker) -> AsyncGRPOTrainer:
    on_cpu: dict[str, Any] = (
        {"use_cpu": True, "bf16": False, "gradient_checkpointing": False} if args.cpu else {}
    )
    config = AsyncGRPOConfig(
        output_dir=str(args.output_dir),
        per_device_train_batch_size=args.batch_size,
        token_budget=0,  # a fixed number of samples a step, not a token budget asked of TRL's own vLLM
        max_steps=args.steps,
        max_staleness=args.max_staleness,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        **on_cpu,
    )
    return AsyncGRPOTrainer(
        model=str(args.model_dir),
        args=config,
        # TRL asks for a dataset; the environments own the prompts, and the worker reads none of it
        train_dataset=Dataset.from_dict({"prompt": ["(played by the environments)"]}),
        processing_class=AutoTokenizer.from_pretrained(args.model_dir),
        rollout_worker=worker,  # type: ignore[arg-type]  # TRL types its queues as a union of two kinds
        weight_transfer=GatewayWeightTransfer(args.gateway, args.model_dir, admin_token=args.admin_token),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train the policy vLLM serves with TRL's AsyncGRPOTrainer on the groups environments "
        "play through the gateway."
    )
    parser.add_argument(
        "--gateway", default="http://127.0.0.1:8100", help="the gateway's URL (default: %(default)s)"
    )
    parser.add_argument(
        "--db", default="sqlite:///gateway.db", help="the gateway's store: its --db (default: %(default)s)"
    )
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("GATEWAY_ADMIN_TOKEN"),
        help="the gateway's --admin-token, if it has one (default: $GATEWAY_ADMIN_TOKEN)",
    )
    parser.add_argument(
        "--model-dir", type=Path, required=True, help="the directory vLLM serves: the policy's weights"
    )
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples a step (default: %(default)s)")
    parser.add_argument(
        "--groups-per-claim",
        type=int,
        default=8,
        help="groups the worker claims at once (default: %(default)s)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="skip groups more than this many policy versions behind the trainer (default: %(default)s)",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="(default: %(default)s)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("trl-async-out"),
        help="TRL's output directory (default: %(default)s)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="train on the CPU, in float32, without gradient checkpointing"
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    build_trainer(args, build_worker(args)).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
