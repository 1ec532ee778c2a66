"""Exact mode for chat completions: the prompt of a turn that extends an earlier one holds the model's earlier
replies as the ids it sampled.

render (vLLM's own rendering of the messages: the plain prompt, by the backend or in the gateway with
`--local-render`, `local_render.py`) -> splice onto the parent turn's exact ids
(`gateway.turns.splice`) -> vLLM's chat endpoint, with that prompt given as ids. vLLM takes a chat request's
prompt as ids from `kv_transfer_params.prompt_token_ids` (its decode-side reuse of a prefill's ids): it
skips its own rendering and runs the rest of its chat path as for any call (sampling, its reasoning and tool
parsers, streaming, usage, `n` choices). The agent gets vLLM's own reply, whole or streamed, relayed as in
pass-through; the work per turn grows with prompt + reply (one render, one generation), not with their
product. The turn stores the prompt ids vLLM reports it used: where vLLM rendered the messages itself (it
does for `echo` and for non-text content), the turn records why the splice did not hold.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from gateway.errors import ApiError
from gateway.turns.capture import ChatCapture
from gateway.turns.context import TurnContext
from gateway.turns.splice import END_OF_TURN_REASONS, splice
from gateway.turns.upstream import post_json
from rollout_store.tokens import ID_DTYPE

RENDER = "/v1/chat/completions/render"


async def exact_prompt(ctx: TurnContext, capture: ChatCapture, body: dict[str, Any]) -> list[int]:
    """The turn's prompt: the plain render, spliced onto the parent's exact ids when the turn extends one."""
    record = capture.record
    render_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    # The store finds the parent during the render: the lookup costs the turn no time of its own.
    looked_up = asyncio.ensure_future(ctx.recorder.parent_of(record.rollout_id, body["messages"]))
    try:
        rendered = await _render(ctx, capture, render_body)
    except BaseException:
        looked_up.cancel()
        raise
    plain = np.asarray(rendered, dtype=ID_DTYPE)
    record.plain_prompt_ids = plain
    parent = await looked_up
    if parent is None:
        record.splice = "render"
        prompt = plain
    else:
        closing = None
        if parent.finish_reason not in END_OF_TURN_REASONS and parent.messages is not None:
            closing = await _closing(ctx, capture, render_body, len(parent.messages), plain)
        spliced = splice(parent.sequence, parent.completions, parent.finish_reason, plain, closing)
        record.splice = spliced.how
        record.prompt_completions = spliced.completions
        prompt = spliced.prompt_ids
    capture.sent_prompt = capture.prompt_ids = prompt  # vLLM's reply says which it used
    return list(prompt.tolist())


async def _render(ctx: TurnContext, capture: ChatCapture, body: dict[str, Any]) -> list[int]:
    """vLLM's render of a chat request's messages: in the gateway where it renders this model, else by the
    backend."""

    async def backend_render() -> list[int]:
        rendered = await post_json(ctx.engine, capture, body, RENDER)
        return list(rendered["token_ids"])

    model = capture.record.model  # an adapter renders as its base model does
    return await ctx.local_render.render(ctx.adapters.bases.get(model or "", model), body, backend_render)


async def _closing(
    ctx: TurnContext, capture: ChatCapture, render_body: dict[str, Any], reply_at: int, plain: np.ndarray
) -> int | None:
    """The token the template closes a cut reply with: the one the plain render puts right after the reply's
    text, found by rendering the history up to that reply left open (None where the two renders do not
    agree)."""
    messages = render_body["messages"][: reply_at + 1]
    if len(messages) <= reply_at or messages[-1].get("role") != "assistant":
        return None
    body = {
        **render_body,
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    try:
        open_reply = await _render(ctx, capture, body)
    except ApiError:
        return None
    size = len(open_reply)
    if size >= plain.shape[0] or not np.array_equal(plain[:size], open_reply):
        return None
    return int(plain[size])


def with_prompt(upstream: dict[str, Any], prompt: list[int]) -> None:
    """The chat request, its prompt given as ids (kept beside any transfer parameters the agent sent)."""
    given = upstream.get("kv_transfer_params")
    upstream["kv_transfer_params"] = {
        **(given if isinstance(given, dict) else {}),
        "prompt_token_ids": prompt,
    }
