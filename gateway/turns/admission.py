"""Which agent calls go through: the rollout's key, its registration and status, and its limits.

Every refusal happens before any engine time is spent. A call refused by a limit raises `Refusal`, which
`forward` stores as a `refused` turn (the rollout records which limit stopped its agent, `end_reason`); the
answer is a 400 that the OpenAI SDKs do not retry, so a harness ends cleanly.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from gateway.auth import check_agent_key
from gateway.errors import ApiError, store_failure
from gateway.store.records import Limits, RolloutState, not_running
from gateway.turns.capture import TurnCapture
from gateway.turns.context import TurnContext
from gateway.turns.upstream import post_json
from rollout_store.status import Limit, RolloutStatus

_RENDER_KEYS = (
    "model", "messages", "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs",
)  # fmt: skip
"""Request fields that shape the rendered prompt: what /tokenize needs to count it."""


class Refusal(ApiError):
    """A rollout limit stops the call."""

    def __init__(self, limit: Limit, message: str, code: str) -> None:
        super().__init__(400, message, code)
        self.limit = limit


async def admit(ctx: TurnContext, request: Request, rollout_id: str) -> RolloutState | None:
    """The rollout's state if the call may go on; raises the agent-facing error otherwise."""
    ctx.traffic.check_confirmed()  # before the store is read: it may be what this process lost
    rollout = await ctx.recorder.rollout_state(rollout_id)
    if ctx.rollout_keys:
        check_agent_key(request, rollout_id, rollout)
    if rollout is None and ctx.require_registered:
        raise ApiError(404, f"rollout {rollout_id!r} is not registered", "rollout_not_found")
    if rollout is not None and rollout.status != RolloutStatus.RUNNING:
        raise store_failure(not_running(rollout_id, rollout.status))
    return rollout


def limits_of(ctx: TurnContext, rollout: RolloutState | None) -> Limits:
    return rollout.limits.over(ctx.limits) if rollout is not None else ctx.limits


def check_turn_limit(capture: TurnCapture, rollout: RolloutState | None, limits: Limits) -> None:
    calls = rollout.calls if rollout is not None else 0
    if limits.max_turns is not None and calls >= limits.max_turns:
        message = f"rollout {capture.record.rollout_id!r} reached its limit of {limits.max_turns} model calls"
        raise Refusal(Limit.MAX_TURNS, message, "rollout_turn_limit")


def completion_room(limit: int, prompt_tokens: int) -> int | None:
    """Tokens a reply may take under a context limit; None if the prompt alone reaches it."""
    room = limit - prompt_tokens
    return room if room > 0 else None


def check_context_limit(prompt_tokens: int, limit: int) -> int:
    """The room left for the reply, or a refusal when the prompt alone fills the context."""
    room = completion_room(limit, prompt_tokens)
    if room is None:
        message = (
            f"this model's maximum context length is {limit} tokens for this rollout; "
            f"the prompt has {prompt_tokens} tokens"
        )
        raise Refusal(Limit.MAX_CONTEXT_TOKENS, message, "context_length_exceeded")
    return room


def cap_reply(upstream: dict[str, Any], room: int) -> None:
    """Cut the reply's length to `room` tokens, whichever field the agent used (vLLM reads both)."""
    given = [key for key in ("max_completion_tokens", "max_tokens") if isinstance(upstream.get(key), int)]
    for key in given or ["max_tokens"]:
        upstream[key] = min(upstream[key], room) if key in given else room


async def prompt_tokens(ctx: TurnContext, capture: TurnCapture, body: dict[str, Any]) -> int:
    """How many tokens the engine will see, counted by the rollout's backend (`/tokenize`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        capture.prompt_ids = prompt
        return len(prompt)
    if prompt is not None:
        request = {"model": body.get("model"), "prompt": prompt}
    else:
        request = {key: body[key] for key in _RENDER_KEYS if key in body}
        request.setdefault("add_generation_prompt", True)
    tokens = (await post_json(ctx.engine, capture, request, "/tokenize")).get("tokens")
    if not isinstance(tokens, list):
        raise ApiError(502, "backend's /tokenize answered without tokens", "backend_error")
    capture.prompt_ids = tokens
    return len(tokens)
