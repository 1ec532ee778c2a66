"""The OpenAI dialect's request and reply models: what `/openapi.json` documents, and what the gateway checks.

The chat request is the turn layer's (`gateway.turns.requests`, where every dialect's call ends up): these are
the other requests, read as leniently as it is and forwarded as sent. Replies are vLLM's own; their models
document the fields clients rely on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from gateway.turns.requests import ChatCompletionRequest, ModelName, Open, SamplingFields

MAX_TOKEN_ID = 2**31 - 1
"""The largest id the store packs (32-bit, `rollout_store.tokens.ID_DTYPE`)."""
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
"""A prompt id the gateway records: a JSON integer (not `"5"`, `1.0` or `true`, which vLLM would read as
something else than the gateway packs) that fits the store."""


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
