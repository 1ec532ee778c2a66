"""An environment running GRPO groups through the gateway: each task is played by a group of agents, at
most a few rollouts at once across every group, and each rollout is scored and finished with its reward.

    python examples/environment.py --gateway http://127.0.0.1:8100 --model policy \
        --group-size 4 --concurrency 2

For every task, `--group-size` members; each member is created only when it starts (`POST /rollouts` with the
group's id and its declared `group_size`), played by the agent of `examples/agent.py` on the rollout's
`base_url` (in a thread, as a harness would run in a process of its own), scored by a toy reward, and finished
(`POST /rollouts/{id}/finish {"reward": r}`). An `asyncio.Semaphore` keeps at most `--concurrency` rollouts
running at once, so a group's first members finish before its last ones exist: the declared size is what
keeps trainers from taking them as a group of their own (the gateway serves the group once that many members
have finished).

With a gateway started with --control-token, give it as `--control-token` (or $GATEWAY_CONTROL_TOKEN). Each
run names its groups `<run>-<task number>` (`--run`, a fresh id by default): a group that has all its members
takes no more (409), so each run plays groups of its own. With `--sampling-seed`, every agent's calls sample
with seeds of their own, the same in every run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections import defaultdict

import httpx
from agent import run_agent  # examples/agent.py, beside this file

TASKS = (
    "Name three prime numbers.",
    "Describe the sea in one sentence.",
    "Write a short line about rain.",
)
TIMEOUT = 600.0
"""Seconds for each control call, connecting included."""


def reward(task: str, reply: str) -> float:
    """A toy reward with some spread inside a group: the share of the reply's characters that are letters.
    A real environment runs the task's tests, a checker or a reward model here."""
    return round(sum(ch.isalpha() for ch in reply) / max(len(reply), 1), 4)


async def play(
    control: httpx.AsyncClient,
    running: asyncio.Semaphore,
    args: argparse.Namespace,
    group_id: str,
    task: str,
    seed: int | None,
) -> tuple[str, float | None]:
    """One member of `group_id`: created when a slot frees, played, scored and finished; (its group, reward).

    An agent that fails is finished `failed` (trainers skip it; the rest of its group still trains)."""
    async with running:
        body = {"group_id": group_id, "group_size": args.group_size, "task_id": task}
        created = (await control.post("/rollouts", json=body)).raise_for_status().json()
        rollout_id = created["rollout_id"]
        api_key = created["api_key"] or "unused"  # the rollout's own key with --rollout-keys
        try:
            reply = await asyncio.to_thread(
                run_agent,
                created["base_url"],
                api_key,
                args.model,
                task,
                max_tokens=args.max_tokens,
                seed=seed,
            )
        except Exception as exc:  # whatever the agent raised: the rollout failed, the run goes on
            print(f"rollout {rollout_id} failed: {exc}", file=sys.stderr)
            await finish(control, rollout_id, {"status": "failed"})
            return group_id, None
        score = reward(task, reply)
        await finish(control, rollout_id, {"status": "completed", "reward": score})
        return group_id, score


async def finish(control: httpx.AsyncClient, rollout_id: str, body: dict[str, object]) -> None:
    (await control.post(f"/rollouts/{rollout_id}/finish", json=body)).raise_for_status()


def member_seed(sampling_seed: int | None, member: int) -> int | None:
    """The seed of the run's `member`-th agent (None: unseeded): its two calls take it and the next, so no two
    calls of a run share one, and a run from the same seed samples the same replies."""
    return None if sampling_seed is None else sampling_seed * 1_000_003 + 2 * member


async def run(args: argparse.Namespace) -> dict[str, list[float | None]]:
    """Every task's group, played; each group's rewards (None for a failed member)."""
    running = asyncio.Semaphore(args.concurrency)
    headers = {"authorization": f"Bearer {args.control_token}"} if args.control_token else {}
    groups = [(f"{args.run}-{number}", task) for number, task in enumerate(args.task or TASKS)]
    async with httpx.AsyncClient(base_url=args.gateway, headers=headers, timeout=TIMEOUT) as control:
        roster = [(group_id, task) for group_id, task in groups for _ in range(args.group_size)]
        members = [
            play(control, running, args, group_id, task, member_seed(args.sampling_seed, number))
            for number, (group_id, task) in enumerate(roster)
        ]
        played = await asyncio.gather(*members)
    rewards: dict[str, list[float | None]] = defaultdict(list)
    for group_id, score in played:
        rewards[group_id].append(score)
    return dict(rewards)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run GRPO groups through the gateway: each task played by --group-size agents, at most "
        "--concurrency rollouts at once, each finished with its reward."
    )
    parser.add_argument(
        "--gateway", default="http://127.0.0.1:8100", help="the gateway's URL (default: %(default)s)"
    )
    parser.add_argument(
        "--control-token",
        default=os.environ.get("GATEWAY_CONTROL_TOKEN"),
        help="the gateway's --control-token, if it has one (default: $GATEWAY_CONTROL_TOKEN)",
    )
    parser.add_argument("--model", default="policy", help="the model name vLLM serves (default: %(default)s)")
    parser.add_argument(
        "--task",
        action="append",
        help="a task, at most 256 characters (its rollouts' task_id): one group each; repeat for more "
        "(default: three built-in tasks)",
    )
    parser.add_argument("--group-size", type=int, default=4, help="members a group (default: %(default)s)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="rollouts running at once, across every group (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="tokens a reply may take (default: %(default)s)"
    )
    parser.add_argument(
        "--run", default=uuid.uuid4().hex[:8], help="the prefix of this run's group ids (default: a fresh id)"
    )
    parser.add_argument(
        "--sampling-seed",
        type=int,
        help="seed every agent call's sampling from this, for a run that repeats (default: unseeded)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.group_size < 1 or args.concurrency < 1:
        parser.error("--group-size and --concurrency must be at least 1")
    try:
        groups = asyncio.run(run(args))
    except httpx.HTTPStatusError as exc:
        print(
            f"environment: {exc.request.method} {exc.request.url.path}: {exc.response.text}", file=sys.stderr
        )
        return 1
    except httpx.TransportError as exc:
        print(f"environment: cannot reach the gateway at {args.gateway}: {exc}", file=sys.stderr)
        return 1
    for group_id, rewards in groups.items():
        print(f"group {group_id}: rewards {' '.join('failed' if r is None else f'{r:.4f}' for r in rewards)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
