"""SkyRL's `GeneratorOutput` from claimed samples: what a SkyRL `GeneratorInterface` whose agents played
through the gateway returns to SkyRL's trainer, built from the ids vLLM saw and sampled.

    python examples/skyrl_output.py --db sqlite:///gateway.db

One row per trajectory (merged samples: a multi-turn rollout is one row, `prompt_token_ids` its first
prompt, `response_ids` every later id, `loss_masks` 1 on the sampled tokens only), with the sampling
`rollout_logprobs`, `rewards` and `stop_reasons`; `--step-wise` gives one row per model call with
`is_last_step`. In a generator, return it for the rollouts it played, in its input's order. It prints one
line per row, or with `--json` the whole output.

SkyRL itself needs Python 3.12 or later: `trainer_client.skyrl` builds the plain dictionary SkyRL's
`GeneratorOutput` describes, without importing SkyRL, and the suite (on Python 3.11) checks this example's
output field by field against SkyRL's documented layout and the store, not with SkyRL's own classes.
"""

from __future__ import annotations

import argparse
import json
import sys

from trainer_client import SampleOptions, TrainerClient
from trainer_client.skyrl import generator_output


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Claim ready groups from the gateway's store and build SkyRL's GeneratorOutput from them."
    )
    parser.add_argument(
        "--db", default="sqlite:///gateway.db", help="the gateway's store: its --db (default: %(default)s)"
    )
    parser.add_argument(
        "--trainer-id", default="skyrl-0", help="the name the claim is taken under (default: %(default)s)"
    )
    parser.add_argument(
        "--step", type=int, default=0, help="the training step claiming (default: %(default)s)"
    )
    parser.add_argument(
        "--max-groups", type=int, default=8, help="groups to claim at most (default: %(default)s)"
    )
    parser.add_argument("--step-wise", action="store_true", help="one row per model call, not per trajectory")
    parser.add_argument("--json", action="store_true", help="print the whole output as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = SampleOptions(merged=not args.step_wise, max_groups=args.max_groups)
    with TrainerClient(args.db) as client:
        batch = client.claim(args.trainer_id, args.step, options)
    if not batch.samples:
        print("no group is ready to claim", file=sys.stderr)
        return 1
    output = generator_output(batch.samples, step_wise=args.step_wise)
    if args.json:
        print(json.dumps(output))
        return 0
    for row, sample in enumerate(batch.samples):
        print(
            f"{sample.group_id} {sample.rollout_id}: {len(output['prompt_token_ids'][row])} prompt ids, "
            f"{len(output['response_ids'][row])} response ids ({sum(output['loss_masks'][row])} trained), "
            f"reward {output['rewards'][row]}, stop reason {output['stop_reasons'][row]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
