"""Request and response models of the Messages dialect: what is checked before a call is translated (blocks
are checked as they are translated), and what the OpenAPI document shows."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.turns.requests import MAX_REPLY_TOKENS, ModelName


class Message(BaseModel):
    """One message of the conversation. `system` is the mid-conversation system message of Anthropic's beta,
    which Claude Code sends by default (context about the environment, tools and skills after the first user
    message): it becomes a chat system message at its place, rendered as the model's template renders one."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    defer_loading: bool | None = None
    """A deferred tool is not in the model's context until a tool search loads it: it is left out of the
    prompt (Claude Code sends a placeholder tool marked so)."""


class MessagesRequest(BaseModel):
    """Anthropic's Messages request; fields the gateway does not use are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: ModelName
    max_tokens: Annotated[int, Field(ge=1, le=MAX_REPLY_TOKENS)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None


class TokenCount(BaseModel):
    input_tokens: int


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "thinking", "tool_use"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageReply(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str | None
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
