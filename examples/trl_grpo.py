"""TRL's `GRPOTrainer` fed by the gateway: every prompt copy is a rollout an `openai` SDK agent plays through
the gateway, TRL trains on the ids the store recorded (never a re-tokenization of the agent's text), and
vLLM takes each step's weights through the gateway's admin API.

    python examples/trl_grpo.py --gateway http://127.0.0.1:8100 --db sqlite:///gateway.db \
        --model-dir path/to/policy --model policy --steps 100

`--model-dir` is the directory vLLM serves: TRL loads the policy from it, and `GatewayWeightSync` writes each
step's weights there and has every vLLM behind the gateway reload them (vLLM needs VLLM_SERVER_DEV_MODE=1).
The task is the toy task of `scripts/dev demo --train` (`trainer_client.reference.toy_task`: write replies
rich in the letter e), which the tiny model of the tests learns on a CPU within a few steps, given
`--cpu --learning-rate 1e-2 --max-tokens 16`; put your prompts in the dataset and your agent and its reward
in `make_agent`. Needs the `trl` extra (`pip install 'rl-gateway[trl]'`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from typing import Any

import openai
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl exports them lazily

from trainer_client.reference.toy_task import TargetCharactersTask
from trainer_client.trl import Agent, GatewayRollouts, GatewayWeightSync, Rollout

TASK = TargetCharactersTask()


def make_agent(model: str, max_tokens: int, sampling_seed: int | None = None) -> Agent:
    """The agent of one rollout: any harness works, given OPENAI_BASE_URL=rollout.base_url.

    With `sampling_seed`, the n-th call samples with seed `sampling_seed * 1_000_003 + n`: a run that starts
    from the same weights samples the same replies (the agents start in the order TRL hands the prompts)."""
    seeds = itertools.count(sampling_seed * 1_000_003) if sampling_seed is not None else None

    async def agent(prompt: str, rollout: Rollout) -> float:
        seed = None if seeds is None else next(seeds)  # null: vLLM samples unseeded
        async with openai.AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.api_key) as client:
            reply = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=1.0,  # the trainer's: vLLM's logprobs are of this distribution
                seed=seed,
            )
        return TASK.score([[reply.choices[0].message.content or ""]])[0]

    return agent


def build_trainer(
    args: argparse.Namespace, agent: Agent, trainer_class: type[GRPOTrainer] = GRPOTrainer
) -> tuple[GRPOTrainer, GatewayRollouts, GatewayWeightSync]:
    """The trainer (`trainer_class`: GRPOTrainer or a subclass of it), its rollout function and the weight
    sync; close the rollouts when training is over."""
    rollouts = GatewayRollouts(args.gateway, args.db, agent, control_token=args.control_token)
    sync = GatewayWeightSync(args.gateway, args.model_dir, admin_token=args.admin_token)
    on_cpu: dict[str, Any] = {"use_cpu": True, "bf16": False} if args.cpu else {}
    config = GRPOConfig(
        output_dir=str(args.output_dir),
        **on_cpu,
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        num_generations=args.group_size,  # the copies of a prompt: one GRPO group
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
    )
    trainer = trainer_class(
        model=str(args.model_dir),
        reward_funcs=rollouts.reward,  # the rewards the agents returned, as stored
        args=config,
        train_dataset=Dataset.from_dict({"prompt": list(TASK.prompts)}),
        processing_class=AutoTokenizer.from_pretrained(args.model_dir),
        rollout_func=rollouts,
        callbacks=[sync],
    )
    return trainer, rollouts, sync


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train the policy vLLM serves with TRL's GRPOTrainer, its rollouts played through the "
        "gateway."
    )
    parser.add_argument(
        "--gateway", default="http://127.0.0.1:8100", help="the gateway's URL (default: %(default)s)"
    )
    parser.add_argument(
        "--db", default="sqlite:///gateway.db", help="the gateway's store: its --db (default: %(default)s)"
    )
    parser.add_argument(
        "--control-token",
        default=os.environ.get("GATEWAY_CONTROL_TOKEN"),
        help="the gateway's --control-token, if it has one (default: $GATEWAY_CONTROL_TOKEN)",
    )
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("GATEWAY_ADMIN_TOKEN"),
        help="the gateway's --admin-token, if it has one (default: $GATEWAY_ADMIN_TOKEN)",
    )
    parser.add_argument(
        "--model-dir", type=Path, required=True, help="the directory vLLM serves: the policy's weights"
    )
    parser.add_argument("--model", default="policy", help="the model name vLLM serves (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default: %(default)s)")
    parser.add_argument(
        "--prompts-per-step", type=int, default=4, help="prompts (groups) a step (default: %(default)s)"
    )
    parser.add_argument(
        "--group-size", type=int, default=8, help="rollouts a prompt: num_generations (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="tokens a reply may take (default: %(default)s)"
    )
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="(default: %(default)s)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("trl-out"),
        help="TRL's output directory (default: %(default)s)",
    )
    parser.add_argument("--cpu", action="store_true", help="train on the CPU, in float32")
    parser.add_argument("--seed", type=int, default=0, help="TRL's seed (default: %(default)s)")
    parser.add_argument(
        "--sampling-seed",
        type=int,
        help="seed every agent call's sampling from this, for a run that repeats (default: unseeded)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trainer, rollouts, _ = build_trainer(args, make_agent(args.model, args.max_tokens, args.sampling_seed))
    try:
        trainer.train()
    finally:
        rollouts.close()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    print("mean reward per step:", " ".join(f"{reward:.3f}" for reward in rewards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
