"""GRPO on a LoRA policy through the gateway: the reference trainer trains an adapter of the frozen base model
vLLM serves, and publishes each step's adapter as the policy's next version, with no pause of the fleet.

    python examples/lora_grpo.py --db sqlite:///gateway.db --model-dir path/to/base --adapter-dir adapters

The gateway serves the policy as a LoRA adapter of the base (`--lora-policy agent=BASE`), on vLLM servers
started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (see the LoRA guide). Version N is
saved in PEFT's format to `--adapter-dir`/vN, a directory every server must be able to read; none may exist
yet. Each version plays `--groups-per-step` GRPO groups of the toy task (8 agents on one prompt, rewarded
for the target characters in their replies), then one step trains on them and publishes the next version:
on policy, every rollout runs on the version the step after it trains. Sampling is seeded, so a run repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from trainer_client.lora import LoRAConfig
from trainer_client.reference.runner import RolloutRunner, RunnerConfig
from trainer_client.reference.toy_task import TargetCharactersTask
from trainer_client.reference.trainer import GRPOTrainer, LoRAPolicy, StepReport, TrainerConfig


async def train(config: TrainerConfig, policy: str, steps: int) -> list[StepReport]:
    """Each version's groups played to their end, then trained on in one step that publishes the next
    version; the last version's groups are played too, so that its reward is known."""
    trainer = await asyncio.to_thread(GRPOTrainer, config)  # publishes version 0
    runner = RolloutRunner(
        config.gateway_url,
        TargetCharactersTask(),
        RunnerConfig(model=policy, groups_in_flight=config.groups_per_step, seed=config.seed),
        name=f"lora-{config.seed}",
        control_token=config.admin_token,
    )
    reports = []
    try:
        for step in range(steps):
            await runner.run(groups=config.groups_per_step)
            report = await asyncio.to_thread(trainer.step, step)
            reports.append(report)
            print(report.line(), flush=True)  # `v` is the version the step published
        await runner.run(groups=config.groups_per_step)
    finally:
        await runner.close()
        trainer.close()
    return reports


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a LoRA policy of the gateway with GRPO on the toy task, publishing each step's "
        "adapter as the policy's next version."
    )
    parser.add_argument(
        "--db", default="sqlite:///gateway.db", help="the gateway's store: its --db (default: %(default)s)"
    )
    parser.add_argument(
        "--gateway", default="http://127.0.0.1:8100", help="the gateway's URL (default: %(default)s)"
    )
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("GATEWAY_ADMIN_TOKEN"),
        help="the gateway's --admin-token, if it has one (default: $GATEWAY_ADMIN_TOKEN)",
    )
    parser.add_argument(
        "--model-dir", type=Path, required=True, help="the base model's directory (read, never written)"
    )
    parser.add_argument(
        "--adapter-dir", type=Path, required=True, help="where version N is saved, as vN (new directories)"
    )
    parser.add_argument(
        "--policy", default="agent", help="the gateway's --lora-policy name (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (default: %(default)s)")
    parser.add_argument(
        "--groups-per-step", type=int, default=4, help="groups of 8 each version plays (default: %(default)s)"
    )
    parser.add_argument("--rank", type=int, default=8, help="the adapter's rank (default: %(default)s)")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=5e-2,
        help="LoRA wants more than full weights: 1e-2 learnt little in 10 steps (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="threads for the trainer's torch (1 leaves a small machine to vLLM; default: torch's choice)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = TrainerConfig(
        model_dir=args.model_dir,
        db=args.db,
        gateway_url=args.gateway,
        admin_token=args.admin_token,
        groups_per_step=args.groups_per_step,
        learning_rate=args.learning_rate,
        entropy_bonus=0.02,  # keeps the small policy from turning deterministic before it has learnt
        max_staleness=0,
        seed=args.seed,
        torch_threads=args.torch_threads,
        lora=LoRAPolicy(args.policy, args.adapter_dir, LoRAConfig(rank=args.rank, alpha=2 * args.rank)),
    )
    asyncio.run(train(config, args.policy, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
