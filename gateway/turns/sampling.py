"""Trainer-controlled sampling: a harness picks its own temperature and reply length, but RL needs the trainer
to decide how the policy samples. A rollout's `sampling` (over the gateway's `--sampling`) replaces those
fields of every call the rollout's agent makes; `max_tokens` caps what the harness asks rather than
replacing it. The turn records the parameters actually sent.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gateway.encoding import RequestModel

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Sampling(RequestModel):
    """vLLM sampling fields a trainer may impose; any other is refused (a typo must not pass silently)."""

    temperature: NonNegative | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """A cap: the harness's own `max_tokens` (or `max_completion_tokens`) if lower, else this."""
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's structured outputs (`regex`, `json`, `choice`, `grammar`, ...): force what the policy writes."""


ENGINE_FIELDS = tuple(name for name in Sampling.model_fields if name != "max_tokens")
"""vLLM's own sampling fields: a dialect translated to chat passes them on when an agent adds them (the SDKs'
`extra_body`), as vLLM's chat endpoint takes them."""


def merged(default: dict[str, Any] | None, rollout: dict[str, Any] | None) -> dict[str, Any]:
    """The fields a call of the rollout gets: the gateway's defaults, overridden field by field."""
    return {**(default or {}), **(rollout or {})}


def imposed(body: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    """The agent's request with the trainer's sampling fields in place of its own."""
    if not sampling:
        return body
    fields = dict(sampling)
    cap = fields.pop("max_tokens", None)
    out = {**body, **fields}
    if cap is not None:
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        asked = body.get(key)
        out[key] = cap if not isinstance(asked, int) else min(asked, cap)
    return out
