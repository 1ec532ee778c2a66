"""The agent API's request and reply models: what `/openapi.json` documents, and what the gateway checks.

Requests are validated as leniently as vLLM validates them (`"stream": "true"`, `"n": 1.0` and nulls are
accepted, as vLLM accepts them), and forwarded as the agent sent them (plus the token-capture fields), never
re-serialized from these models: fields not listed here pass through to vLLM untouched, so a newer client's
extra parameters keep working. Replies are vLLM's own; their models document the fields clients rely on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ModelName = Annotated[str, Field(max_length=256)]
"""As long as the store's `turns.model` column allows."""
MAX_TOKEN_ID = 2**31 - 1
"""The largest id the store packs (32-bit, `gateway.store.tokens.ID_DTYPE`)."""
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
"""A prompt id the gateway records: a JSON integer (not `"5"`, `1.0` or `true`, which vLLM would read as
something else than the gateway packs) that fits the store."""
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
    """Fields both endpoints share (vLLM's names and types)."""

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


class ChatCompletionTokensRequest(ChatCompletionRequest):
    """A chat request whose prompt the client gives as ids (`tokens`), as token-aware RL clients send it: the
    messages are kept with the turn, the engine generates from `tokens`."""

    tokens: Annotated[list[TokenId], Field(min_length=1)]


class TokenRouteRequest(BaseModel):
    """A /tokenize or /detokenize body, forwarded as sent (vLLM checks it)."""

    model_config = Open

    model: ModelName | None = None


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)]
    """Text, or ids: ids are counted and recorded by the gateway when the rollout has a context limit."""
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0)] | None = None
    suffix: str | None = None


class Usage(BaseModel):
    model_config = Open

    prompt_tokens: int
    completion_tokens: int | None = None
    total_tokens: int


class ChatChoice(BaseModel):
    model_config = Open

    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    """vLLM's chat completion; `prompt_token_ids` and `token_ids` only when the agent asked for them."""

    model_config = Open

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChoice(BaseModel):
    model_config = Open

    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Completion(BaseModel):
    model_config = Open

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    model_config = Open

    id: str
    object: str


class ModelList(BaseModel):
    model_config = Open

    object: Literal["list"]
    data: list[ModelCard]
