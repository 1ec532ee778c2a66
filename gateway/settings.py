"""One settings object for the whole gateway: CLI flags override `GATEWAY_*` environment variables."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="forbid")

    backend: Annotated[list[str], NoDecode] = Field(
        default=["http://127.0.0.1:8000"],
        description="vLLM server base URL; repeat the flag (or comma-separate the variable) for several.",
    )
    db: str = Field(default="sqlite:///gateway.db", description="SQLAlchemy URL of the store.")
    host: str = "127.0.0.1"
    port: int = 8100
    require_registered_rollouts: bool = Field(
        default=False, description="Answer 404 to agent calls on rollout ids not created with POST /rollouts."
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, description="Largest accepted request body.")
    backend_timeout: float = Field(default=600.0, description="Seconds to wait for a backend reply.")
    connect_timeout: float = Field(default=5.0, description="Seconds to wait for a backend connection.")
    max_connections: int = Field(default=1024, description="Connection pool size towards the backends.")
    mode: Literal["exact", "passthrough"] = Field(
        default="passthrough",
        description="exact: splice each turn's prompt onto the exact ids of the turn it extends (needs vLLM's "
        "--enable-scale-out); passthrough: let vLLM render every prompt. Rollouts can override it.",
    )
    policy_version: str = Field(default="0", description="Policy (weights) version stamped on new turns.")
    admin_token: str | None = Field(
        default=None, description="Bearer token the /admin API requires; no token: the admin API is open."
    )
    pause_timeout: float = Field(
        default=600.0, description="Seconds a new agent call waits while the gateway is paused before a 503."
    )
    public_url: str | None = Field(
        default=None, description="Base URL agents reach the gateway at; defaults to the request's own."
    )
    log_level: str = "info"

    @field_validator("backend", mode="before")
    @classmethod
    def _split_backends(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [str(v).strip().rstrip("/") for v in value]
        return value
