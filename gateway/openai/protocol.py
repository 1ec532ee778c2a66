"""What the agent API checks in a request before forwarding it.

Only the fields the gateway relies on are typed; everything else passes through to vLLM untouched, so a
newer client's extra parameters keep working. The request is forwarded as the agent sent it (plus the
token-capture fields), never re-serialized from these models.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


def _single_choice(n: int) -> int:
    if n != 1:
        raise ValueError("only n=1 is supported: a turn records one completion; start one rollout per sample")
    return n


SingleChoice = Annotated[StrictInt, AfterValidator(_single_choice)]
ModelName = Annotated[StrictStr, Field(max_length=256)]
"""As long as the store's `turns.model` column allows."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: SingleChoice = 1
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    return_token_ids: StrictBool | None = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: SingleChoice = 1
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    return_token_ids: StrictBool | None = None
