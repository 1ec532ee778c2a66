"""A GRPO training loop on `trainer_client`: claim ready groups from the gateway's store, compute the policy's
logprobs of the claimed ids with `transformers`, take a `grpo_loss` step, push the new weights to vLLM
through the gateway, commit the claim.

    python examples/trainer_loop.py --db sqlite:///gateway.db --model-dir path/to/policy --steps 10

`--model-dir` is the directory vLLM serves: the policy is loaded from it, and after each step its
`model.safetensors` is replaced and every vLLM behind the gateway reloads it (`GatewayAdmin.weight_sync`:
pause, write, reload, new policy version, resume; vLLM needs VLLM_SERVER_DEV_MODE=1). That suits a trainer
that shares a disk with vLLM; elsewhere, send the weights your own way inside the same `weight_sync` block
(see the weight-sync guide). The samples are the engine's exact ids with its sampling logprobs; rollouts
more than `--max-staleness` policy versions old are skipped at claim time. The claim is leased: if the
trainer dies mid-step, its groups go back to the others when the lease runs out.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from time import monotonic, sleep

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer_client import Batch, GatewayAdmin, SampleOptions, TrainerClient, grpo_loss
from trainer_client.weights import save_weights

POLL = 1.0
"""Seconds between two claims while no group is ready (rollouts keep landing while the trainer works)."""
SAY_WAITING = 30.0
"""Seconds between two lines saying the loop still waits, so that a loop with nothing to train says so."""


def claim(client: TrainerClient, args: argparse.Namespace, step: int, version: int) -> Batch:
    """The next ready groups (up to --groups-per-step), waiting until there is at least one to train on."""
    options = SampleOptions(
        current_version=version, max_staleness=args.max_staleness, max_groups=args.groups_per_step
    )
    started = said = monotonic()
    while True:
        batch = client.claim(args.trainer_id, step, options, lease=args.lease)
        if batch.samples:
            return batch
        if (step == 0 and said == started) or monotonic() - said >= SAY_WAITING:
            said = monotonic()
            print(
                f"step {step}: waiting for a finished group in {args.db} ({said - started:.0f} s so far); "
                "groups come from an environment running rollouts through the gateway "
                "(e.g. examples/environment.py)",
                file=sys.stderr,
                flush=True,
            )
        sleep(POLL)


def train_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, batch: Batch) -> dict[str, float]:
    """One optimizer step on the batch; the ratio is taken against the engine's sampling logprobs."""
    t = batch.padded(pad_id=0)  # position i holds token i's values
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[:, :-1].float()
    # the policy's logprob of each token given those before it: token i + 1's at column i
    logprobs = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, 1:, None]).squeeze(-1)
    loss, stats = grpo_loss(logprobs, t["old_logprobs"][:, 1:], t["advantages"][:, 1:], t["loss_mask"][:, 1:])
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": float(loss.detach()), **stats}


def push_weights(admin: GatewayAdmin, model: PreTrainedModel, model_dir: Path, version: int) -> None:
    """vLLM takes the new weights as policy `version` (on an error, generation resumes at the old one)."""
    with admin.weight_sync(str(version)):  # pause and drain; on exit set the version and resume
        save_weights(model, model_dir)  # model.safetensors replaced in one rename
        admin.reload_weights()  # every backend reloads it from its model directory


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train the policy vLLM serves with GRPO on the groups the gateway's store holds, pushing "
        "its weights to vLLM after each step."
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
        "--model-dir", type=Path, required=True, help="the directory vLLM serves: the policy's weights"
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default: %(default)s)")
    parser.add_argument(
        "--groups-per-step", type=int, default=4, help="groups a step takes at most (default: %(default)s)"
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="skip rollouts more than this many policy versions old (default: %(default)s)",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="(default: %(default)s)")
    parser.add_argument(
        "--trainer-id", default="trainer-0", help="the name claims are taken under (default: %(default)s)"
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=600.0,
        help="seconds a claim holds unless the step commits (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    admin = GatewayAdmin(args.gateway, args.admin_token)
    version = int(admin.state()["policy_version"])  # stamped on new turns: --policy-version, 0 by default
    with TrainerClient(args.db) as client:
        for step in range(args.steps):
            batch = claim(client, args, step, version)
            try:
                stats = train_step(model, optimizer, batch)
                push_weights(admin, model, args.model_dir, version + 1)
            except BaseException:
                client.release(args.trainer_id, step)  # the groups go back for another step
                raise
            version += 1
            client.commit(args.trainer_id, step)
            metrics = batch.metrics()
            print(
                f"step {step}: groups {metrics['groups']:.0f}, rollouts {metrics['rollouts']:.0f}, "
                f"reward {metrics['reward_mean']:.4f}, loss {stats['loss']:+.4f}, "
                f"kl {stats['approx_kl']:.5f} -> policy version {version}",
                flush=True,
            )
    admin.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
