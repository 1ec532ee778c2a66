"""An agent on a rollout: the `openai` SDK pointed at the rollout's `base_url`, as any harness is when given
it as OPENAI_BASE_URL. It holds a two-turn conversation: the second call sends the first reply back with a
follow-up, as agents resend their history, so the gateway stores the second turn as an extension of the
first (`parent_turn`; in exact mode its prompt is the first turn's exact ids plus the new message).

Create a rollout, then run the agent on its base URL (a gateway on 127.0.0.1:8100 in front of a vLLM that
serves the model as `policy`); it prints the last reply:

    curl -s http://127.0.0.1:8100/rollouts -H 'content-type: application/json' -d '{"rollout_id": "r2"}'
    python examples/agent.py --base-url http://127.0.0.1:8100/rollouts/r2/v1 --model policy

`--base-url` defaults to $OPENAI_BASE_URL and `--api-key` to $OPENAI_API_KEY (the rollout's key when the
gateway runs with --rollout-keys; any string otherwise); with `--sampling-seed` it samples the same replies
every run. The agent neither scores nor finishes its rollout: that is the environment's part
(`examples/environment.py` runs this agent for every member of its groups).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

import openai

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

FOLLOW_UP = "Now say it again, in fewer words."
TIMEOUT = 600.0
"""Seconds for each phase of a call, connecting included: an engine busy with many agents can take minutes."""


def run_agent(
    base_url: str, api_key: str, model: str, task: str, *, max_tokens: int = 256, seed: int | None = None
) -> str:
    """Play `task` in two turns through `base_url`; returns the last reply. With `seed`, the two calls sample
    with seeds `seed` and `seed + 1`: the same replies every run from the same weights."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": task}]
    answer = ""
    with openai.OpenAI(base_url=base_url, api_key=api_key, timeout=TIMEOUT) as client:
        for turn, follow_up in enumerate((FOLLOW_UP, None)):
            reply = client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                seed=openai.omit if seed is None else seed + turn,  # omitted: vLLM samples unseeded
            )
            answer = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})  # the history, sent back next turn
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
    return answer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Play a task in two turns with the openai SDK on a rollout's base URL; print the last "
        "reply."
    )
    parser.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL"),
        help="the rollout's base_url, as POST /rollouts answers it (default: $OPENAI_BASE_URL)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "unused"),
        help="the rollout's api_key with --rollout-keys, else any string (default: $OPENAI_API_KEY)",
    )
    parser.add_argument("--model", default="policy", help="the model name vLLM serves (default: %(default)s)")
    parser.add_argument("--task", default="Name three prime numbers.", help="the first user message")
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="tokens a reply may take (default: %(default)s)"
    )
    parser.add_argument(
        "--sampling-seed",
        type=int,
        help="seed the two calls' sampling from this, for replies that repeat (default: unseeded)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.base_url:
        parser.error(
            "give --base-url (or OPENAI_BASE_URL): a rollout's base_url, as POST /rollouts answers it"
        )
    try:
        print(
            run_agent(
                args.base_url,
                args.api_key,
                args.model,
                args.task,
                max_tokens=args.max_tokens,
                seed=args.sampling_seed,
            )
        )
    except openai.APIError as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
