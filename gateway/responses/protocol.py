"""Request and response models of the Responses dialect: what is checked before a call is translated (input
items are checked as they are translated), and what the OpenAPI document shows."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.turns.requests import MAX_REPLY_TOKENS, ModelName

Open = ConfigDict(extra="allow")


class ResponsesRequest(BaseModel):
    """OpenAI's Responses request; fields the gateway does not use are accepted and kept with the turn."""

    model_config = Open

    model: ModelName
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    """Continue from a stored response of this rollout: its conversation and reply come before `input`."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_REPLY_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    store: bool | None = True
    """False: the turn is still recorded for training, but the response cannot be fetched or continued."""
    stream: bool | None = False


class OutputItem(BaseModel):
    model_config = Open

    type: Literal["message", "reasoning", "function_call", "custom_tool_call"]
    id: str


class Usage(BaseModel):
    model_config = Open

    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(BaseModel):
    """A response, as created or as fetched again (`GET .../responses/{id}`)."""

    model_config = Open

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled"]
    model: str | None
    output: list[OutputItem]
    usage: Usage | None
