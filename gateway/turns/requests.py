"""The chat request every dialect's call becomes before the turn layer forwards it: OpenAI's chat completion,
as vLLM reads it. The OpenAI dialect takes it as sent; Messages and Responses translate to it and check the
translation against it, so that a translated call meets the same limits as a chat call.

Requests are validated as leniently as vLLM validates them (`"stream": "true"`, `"n": 1.0` and nulls are
accepted, as vLLM accepts them), and forwarded as the agent sent them (plus the token-capture fields), never
re-serialized from these models: fields not listed here pass through to vLLM untouched, so a newer client's
extra parameters keep working. The one rewrite is of the integers listed here: `5.0` is sent on as 5, the
number the gateway caps and compares (`gateway.turns.intake.validated`); `true` is refused rather than read
as 1.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

ModelName = Annotated[str, Field(max_length=256)]
"""As long as the store's `turns.model` column allows."""
MAX_CHOICES = 128
"""`n`'s ceiling, as OpenAI's own API sets it: each choice is a turn the gateway stores."""
MAX_REPLY_TOKENS = 2**31 - 1
"""A reply-length field the gateway compares and caps: beyond any context. Lower values (0, negative) are
vLLM's to refuse, in its own words."""
ReplyTokens = Annotated[int, Field(le=MAX_REPLY_TOKENS)]
StopParam = str | list[str] | None
Open = ConfigDict(extra="allow")


class ChatMessage(BaseModel):
    model_config = Open

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = Open

    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """Fields chat and completions share (vLLM's names and types)."""

    model_config = Open

    model: ModelName | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = 1
    """Several choices of one prompt (a GRPO group from one call): each is stored as its own turn."""
    max_tokens: ReplyTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: StopParam = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    return_token_ids: bool | None = None
    """Ask for the engine's token ids in the reply (the gateway records them either way)."""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: ReplyTokens | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
