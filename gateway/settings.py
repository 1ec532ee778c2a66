"""One settings object for the whole gateway: CLI flags override `GATEWAY_*` environment variables."""

from __future__ import annotations

import importlib.util
import json
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.store.database import check_url, is_sqlite
from gateway.store.status import Mode
from gateway.telemetry import missing_packages
from gateway.turns.sampling import Sampling


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="forbid")

    backend: Annotated[list[str], NoDecode] = Field(
        default=["http://127.0.0.1:8000"],
        description="vLLM server base URL; repeat the flag (or comma-separate the variable) for several.",
    )
    backend_file: str | None = Field(
        default=None,
        description="File listing vLLM server URLs, one a line (# starts a comment), instead of --backend; "
        "re-read when it changes: new servers join, servers no longer listed leave.",
    )
    health_interval: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between health checks of each backend (/health, /v1/models, /metrics); two "
        "failed checks in a row eject a server, one passing check re-admits it.",
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
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="Calls each backend takes at once (one connection each); more wait in a queue.",
    )
    max_queued: int = Field(
        default=4096,
        ge=0,
        description="Calls that may wait for a backend connection, all backends together; past that, a "
        "call is answered 503 with retry-after (clients retry it).",
    )
    mode: Mode = Field(
        default=Mode.PASSTHROUGH,
        description="exact: splice each turn's prompt onto the exact ids of the turn it extends (needs "
        "vLLM's --enable-scale-out); passthrough: let vLLM render every prompt. Rollouts can override it.",
    )
    local_render: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="Exact mode renders prompts in the gateway with vLLM's own renderer, built from the "
        "arguments the backend got from `vllm serve` (the model, then those that shape a render: "
        "--served-model-name, --chat-template, tool and reasoning parsers); one flag per model (the "
        "variable: ';' between models). Saves a round trip and vLLM's JSON of the prompt's ids; needs vLLM "
        "installed here and the model's tokenizer files. A model's first turn is rendered by both; the "
        "backend keeps rendering if they differ.",
    )
    policy_version: str = Field(default="0", description="Policy (weights) version stamped on new turns.")
    control_token: SecretStr | None = Field(
        default=None,
        description="Bearer token the control API (/rollouts: create, reward, finish, read) requires; "
        "no token: it is open to anyone who reaches the gateway.",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bearer token the /admin API requires; default: the control token; neither: it is open.",
    )
    rollout_keys: bool = Field(
        default=False,
        description="POST /rollouts answers a random api_key per rollout; that rollout's agent calls need it "
        "as their bearer token (the OpenAI SDK's api_key), and no other key opens them.",
    )
    backend_api_key: SecretStr | None = Field(
        default=None, description="Bearer token the gateway sends to its backends (vLLM's --api-key)."
    )
    max_turns: int | None = Field(
        default=None,
        ge=1,
        description="Default limit of model calls per rollout (POST /rollouts limits override).",
    )
    max_context_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Default limit of prompt + completion tokens of one call (POST /rollouts limits "
        "override).",
    )
    sampling: Sampling | None = Field(
        default=None,
        description="JSON object of vLLM sampling fields imposed on every agent call (temperature, top_p, "
        "top_k, seed, structured_outputs, ...; max_tokens caps the agent's own); POST /rollouts sampling "
        "overrides them field by field.",
    )
    pause_timeout: float = Field(
        default=600.0, description="Seconds a new agent call waits while the gateway is paused before a 503."
    )
    public_url: str | None = Field(
        default=None, description="Base URL agents reach the gateway at; defaults to the request's own."
    )
    log_level: str = "info"
    access_log: bool = Field(
        default=True,
        description="Log one info line per HTTP call (gateway.access): method, path, status, latency to the "
        "last byte, rollout.",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces URL of an OpenTelemetry collector (e.g. "
        "http://collector:4318/v1/traces): each turn becomes a span (GenAI semantic conventions), sent "
        "there; needs the otel extra. Unset: no traces.",
    )
    workers: int = Field(
        default=1,
        ge=1,
        description="Gateway processes sharing the port (PostgreSQL only): more throughput on more cores; "
        "like replicas on other hosts, they share the run state through the store.",
    )
    heartbeat_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between a process's heartbeats in the store (PostgreSQL): each also picks up "
        "a fleet change whose notification it missed.",
    )
    process_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds without a heartbeat after which a gateway process is taken for dead "
        "(PostgreSQL): admin changes and pauses stop waiting for it. A process that cannot reach the store "
        "for half this time answers agent calls 503 until it can.",
    )

    @field_validator("db")
    @classmethod
    def _usable_db(cls, value: str) -> str:
        return check_url(value)

    @field_validator("workers")
    @classmethod
    def _workers_share_postgresql(cls, value: int, info: ValidationInfo) -> int:
        db = info.data.get("db")
        if value > 1 and db is not None and is_sqlite(db):
            raise ValueError(
                "several workers need a PostgreSQL store (--db postgresql://...): SQLite takes one writer"
            )
        return value

    @field_validator("heartbeat_interval", "process_timeout")
    @classmethod
    def _processes_share_postgresql(cls, value: float, info: ValidationInfo) -> float:
        db, default = info.data.get("db"), cls.model_fields[str(info.field_name)].default
        if value != default and db is not None and is_sqlite(db):
            raise ValueError(
                "for gateway processes sharing a PostgreSQL store; a SQLite store has one process"
            )
        return value

    @field_validator("control_token", "admin_token", "backend_api_key")
    @classmethod
    def _no_empty_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("an empty token would let anyone in: give a real token or leave the option out")
        return value

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling_json(cls, value: object) -> object:
        """The flag gives a JSON object as text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {exc}") from None
        return value

    @field_validator("local_render", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(";") if part.strip()]
        return value

    @field_validator("local_render")
    @classmethod
    def _vllm_here(cls, value: list[str]) -> list[str]:
        if value and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "vLLM's renderer runs in the gateway's process: install vLLM beside the gateway (the "
                "backend's version; rl-gateway[engine] on CPU)"
            )
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _traces_exportable(cls, value: str | None) -> str | None:
        """Said at start-up, in one line, rather than by a failed export at the first turn."""
        if value is None:
            return value
        url = urlsplit(value)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError("not an http(s) URL (e.g. http://collector:4318/v1/traces)")
        missing = missing_packages()
        if missing is not None:
            raise ValueError(missing)
        return value

    @field_validator("backend", mode="before")
    @classmethod
    def _split_backends(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [str(v).strip().rstrip("/") for v in value]
        return value
