"""A turn's requests to its rollout's backend. Failures are raised as the agent-facing `ApiError`; the turn's
error record is written once, by `forward`, whatever step failed."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from gateway.encoding import dumps
from gateway.errors import ApiError, backend_answer, backend_failure
from gateway.fleet.engine import Engine
from gateway.fleet.leaders import Ahead
from gateway.fleet.replies import BackendFailure, BackendReply, BackendStreamError
from gateway.turns.capture import TurnCapture


async def send(
    engine: Engine,
    capture: TurnCapture,
    body: dict[str, Any],
    path: str | None = None,
    ahead: Ahead | None = None,
) -> BackendReply:
    """POST to the rollout's backend; an answer other than 200 is raised as the agent's error. `ahead`: what
    a group's first call sends before it (`gateway.fleet.leaders`)."""
    record = capture.record
    try:
        model = record.adapter or record.model  # a server serves a LoRA policy's version once it lists it
        routed = await engine.send(record.rollout_id, path or capture.path, dumps(body), model, ahead)
        record.backend, reply = routed.url, routed.reply
        record.repinned_from = record.repinned_from or routed.repinned_from
    except BackendFailure as exc:
        record.backend = exc.url or record.backend
        raise backend_failure(exc) from None
    if reply.status != 200:
        try:
            content = await reply.body()
        except BackendStreamError:
            content = b""
        raise backend_answer(reply.status, content)
    return reply


async def read_json(reply: BackendReply, what: str = "a reply") -> Any:
    """A whole reply's JSON; a reply that breaks off or is not JSON is a 502."""
    try:
        return orjson.loads(await reply.body())
    except BackendStreamError as exc:
        raise ApiError(502, str(exc), "backend_error") from None
    except orjson.JSONDecodeError:
        raise ApiError(502, f"backend sent {what} that is not JSON", "backend_error") from None


async def post_json(engine: Engine, capture: TurnCapture, body: dict[str, Any], path: str) -> dict[str, Any]:
    """A whole JSON exchange with the rollout's backend (render, generate, derender, tokenize)."""
    answer = await read_json(await send(engine, capture, body, path), f"a reply to {path}")
    if not isinstance(answer, dict):
        raise ApiError(502, f"backend sent an unexpected reply to {path}", "backend_error")
    return answer


_PROMPT_FIELDS = (
    "model",
    "messages",
    "prompt",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "kv_transfer_params",
)
"""What shapes a call's prompt (exact mode gives its ids in `kv_transfer_params`); sampling fields do not."""
_COPY_DROPS = (
    "stream",
    "stream_options",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
)


def ahead_of(capture: TurnCapture, body: dict[str, Any]) -> Ahead:
    """What a group's first call sends before it: its body asking for one token, not streamed, and the
    digest of what shapes its prompt, which its siblings share."""
    shaping = dumps({name: body[name] for name in _PROMPT_FIELDS if name in body})
    copy = {name: value for name, value in body.items() if name not in _COPY_DROPS} | {"max_tokens": 1}
    return Ahead(hashlib.blake2b(shaping, digest_size=16).hexdigest(), capture.path, dumps(copy))
