"""Exact mode for chat completions, through vLLM's token-in/token-out endpoints.

render (the plain prompt and the sampling parameters) -> splice onto the parent turn's exact ids
(`gateway.turns.splice`) -> generate (token ids in, ids + logprobs out) -> derender (a normal chat
completion for the agent: content, tool calls and reasoning parsed by vLLM). The turn stores the spliced
prompt, the sampled ids and their logprobs; its drift is measured against the plain render.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from starlette.responses import Response

from gateway.store.records import Limits
from gateway.store.tokens import ID_DTYPE
from gateway.turns.admission import cap_reply, check_context_limit
from gateway.turns.capture import Asked, ChatCapture
from gateway.turns.context import TurnContext
from gateway.turns.splice import splice
from gateway.turns.upstream import post_json
from gateway.turns.wire import Wire

RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"


async def prompt_for(ctx: TurnContext, capture: ChatCapture, body: dict[str, Any]) -> dict[str, Any]:
    """The generate request for this turn: vLLM's own, with the prompt spliced onto the parent's exact ids."""
    render_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    request = await post_json(ctx.backends, capture, render_body, RENDER)
    plain = np.asarray(request["token_ids"], dtype=ID_DTYPE)
    record = capture.record
    record.plain_prompt_ids = plain
    parent = await ctx.recorder.parent_of(record.rollout_id, body["messages"])
    if parent is None or parent.sequence is None:
        record.splice = "render"
        return request
    spliced = splice(parent.sequence, parent.completions, parent.finish_reason, plain)
    record.splice = spliced.how
    record.prompt_completions = spliced.completions
    request["token_ids"] = spliced.prompt_ids.tolist()
    return request


def generate_body(
    capture: ChatCapture,
    request: dict[str, Any],
    body: dict[str, Any],
    stream: bool,
    limits: Limits,
) -> dict[str, Any]:
    """The generate request: vLLM's sampling parameters, the agent's reply length, the rollout's context
    limit."""
    sampling = dict(request["sampling_params"])
    # render leaves out parameters equal to vLLM's defaults (max_tokens=16 among them): restate the agent's.
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None:
        sampling["max_tokens"] = limit
    if limits.max_context_tokens is not None:
        capture.prompt_ids = request["token_ids"]
        cap_reply(sampling, check_context_limit(len(request["token_ids"]), limits.max_context_tokens))
    if sampling.get("logprobs") is None:
        sampling["logprobs"] = 0
    return {**request, "sampling_params": sampling, "stream": stream, "return_token_ids": False}


def without_end_token(generated: dict[str, Any]) -> dict[str, Any]:
    """A generate response (or stream event) without its final EOS or stop token: derender would show that
    token as text, where vLLM's chat endpoint does not."""
    choices = generated.get("choices") or []
    if not choices:
        return generated
    choice = choices[0]
    if (
        choice.get("finish_reason") != "stop"
        or isinstance(choice.get("stop_reason"), str)
        or not choice.get("token_ids")
    ):
        return generated
    trimmed = {**choice, "token_ids": choice["token_ids"][:-1]}
    if choice.get("logprobs") and choice["logprobs"].get("content"):
        trimmed["logprobs"] = {**choice["logprobs"], "content": choice["logprobs"]["content"][:-1]}
    return {**generated, "choices": [trimmed]}


async def forward_exact(
    ctx: TurnContext, capture: ChatCapture, body: dict[str, Any], asked: Asked, limits: Limits, wire: Wire
) -> Response:
    """A whole (non-streamed) reply in exact mode; `exact_stream` streams."""
    request = await prompt_for(ctx, capture, body)
    generate = generate_body(capture, request, body, False, limits)
    generated = await post_json(ctx.backends, capture, generate, GENERATE)
    prompt = request["token_ids"]
    derender = {
        "generate_response": without_end_token(generated),
        "chat_request": body,
        "prompt_token_ids": prompt,
        "prompt_tokens": len(prompt),
    }
    payload = await post_json(ctx.backends, capture, derender, DERENDER)
    choice, sampled = payload["choices"][0], generated["choices"][0]
    _agent_reply(payload, body, sampled)
    if (choice.get("message") or {}).get("tool_calls"):
        await _parser_tool_call_ids(ctx, capture, derender, choice["message"]["tool_calls"])
    feed_reply(capture, payload)
    capture.prompt_ids = prompt
    first = capture.choice(0)
    first.completion_ids = sampled["token_ids"]
    capture.record.weight_versions = sampled.get("weight_versions")
    first.logprobs = [entry["logprob"] for entry in (sampled.get("logprobs") or {}).get("content") or ()]
    records = capture.finish()
    for record in records:
        record.finished_at = record.first_token_at = time.time()
        record.http_status = 200
    if asked.token_ids:
        payload["prompt_token_ids"] = prompt
        choice["token_ids"] = sampled["token_ids"]
    capture.strip(payload, asked)
    await ctx.recorder.commit(records)
    return wire.reply(payload)


async def _parser_tool_call_ids(
    ctx: TurnContext, capture: ChatCapture, derender: dict[str, Any], calls: list[dict[str, Any]]
) -> None:
    """Give the tool calls the ids vLLM's chat endpoint would: the parser's own (Mistral's are 9 characters,
    which its templates require back), else `chatcmpl-tool-<random>`.

    Whole-reply derender replaces the parser's ids by bare random ones; its streaming form keeps them, so the
    whole reply is passed through it once as a single finished chunk. A parser that emits nothing from one
    chunk leaves vLLM's default format.
    """
    chunk = {**derender["generate_response"], "choices": derender["generate_response"]["choices"][:1]}
    streamed = await post_json(
        ctx.backends,
        capture,
        {
            "stream": True,
            "generate_chunk": chunk,
            "chat_request": derender["chat_request"],
            "prompt_token_ids": derender["prompt_token_ids"],
        },
        DERENDER,
    )
    ids = {
        call.get("index"): call.get("id")
        for streamed_choice in streamed["chunk"].get("choices") or ()
        for call in (streamed_choice.get("delta") or {}).get("tool_calls") or ()
    }
    for index, call in enumerate(calls):
        call["id"] = ids.get(index) or f"chatcmpl-tool-{call['id']}"


def feed_reply(capture: ChatCapture, reply: dict[str, Any]) -> None:
    """Collect content, reasoning and tool calls from derender; ids and logprobs come from generate."""
    capture.feed(
        {"choices": [{**c, "token_ids": None, "logprobs": None} for c in reply.get("choices") or ()]}
    )


def _agent_reply(payload: dict[str, Any], body: dict[str, Any], sampled: dict[str, Any]) -> None:
    """Make derender's reply read as vLLM's chat endpoint would have written it."""
    choice = payload["choices"][0]
    message = choice.get("message") or {}
    named_tool = isinstance(body.get("tool_choice"), dict)
    if message.get("tool_calls") and choice.get("finish_reason") == "stop" and not named_tool:
        choice["finish_reason"] = "tool_calls"
    stop = sampled.get("stop_reason")
    content = message.get("content")
    if isinstance(stop, str) and isinstance(content, str) and stop in content:
        message["content"] = content[: content.rfind(stop)]
