"""One settings object for the whole gateway: the command line's flags over `GATEWAY_*` environment variables
over a YAML configuration file (`--config`, `GATEWAY_CONFIG`) over the defaults."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
from contextvars import ContextVar
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type information (types-PyYAML is separate)
from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from gateway.fleet.servers import without_user_info
from gateway.telemetry import missing_packages
from gateway.turns.sampling import Sampling
from rollout_store.database import check_url, is_sqlite
from rollout_store.status import Mode

CONFIG_VARIABLE = "GATEWAY_CONFIG"
"""The environment variable naming the configuration file when `--config` does not."""


class Group(StrEnum):
    """The groups of `gateway serve --help` (and of the configuration reference), in their order."""

    SERVER = "server"
    BACKENDS = "backends"
    STORE = "store"
    LIMITS = "limits and sampling"
    SECURITY = "security"
    OBSERVABILITY = "observability"
    PROCESSES = "processes"


GROUP_HELP = {
    Group.SERVER: "Where the gateway listens, the address agents reach it at, how it renders prompts, and "
    "how long it gives its calls in flight when stopped.",
    Group.BACKENDS: "The vLLM servers the gateway sends model calls to.",
    Group.STORE: "The database every model call's tokens are recorded in.",
    Group.LIMITS: "Defaults for every rollout (POST /rollouts can override them per rollout) and the "
    "request limits that protect the gateway.",
    Group.SECURITY: "Who may create rollouts, administer the gateway and make model calls.",
    Group.OBSERVABILITY: "Logs and traces.",
    Group.PROCESSES: "Several gateway processes sharing one PostgreSQL store, on this host or others.",
}


def _in(group: Group) -> dict[str, Any]:
    """A field's place in `--help`: kept on the field itself, so that a new setting cannot miss one."""
    return {"group": group.value}


def group_of(field: FieldInfo) -> Group:
    extra = field.json_schema_extra
    group = extra.get("group") if isinstance(extra, dict) else None
    if not isinstance(group, str):
        raise LookupError(f"setting without a group: {field}")
    return Group(group)


class LogLevel(StrEnum):
    """uvicorn's levels (trace: below debug, every ASGI message)."""

    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"
    TRACE = "trace"


class LogFormat(StrEnum):
    """text: lines for a terminal; json: one object a line, for a log shipper."""

    TEXT = "text"
    JSON = "json"


class PlacementPolicy(StrEnum):
    """group: a rollout joins its GRPO group's server while that server holds no more than its share, so that
    the group's shared prompt is computed once; load: every rollout to the least loaded server."""

    GROUP = "group"
    LOAD = "load"


class ConfigFileError(ValueError):
    """A configuration file the gateway cannot use, said in one line that names the file (and the key)."""


_CONFIG_FILE: ContextVar[str | None] = ContextVar("config_file", default=None)
"""The file `Settings(_config_file=...)` reads, for the duration of its construction (pydantic-settings builds
its sources in a classmethod)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="forbid")

    def __init__(self, _config_file: str | None = None, **values: Any) -> None:
        """`_config_file`: the YAML file to read under the flags and the environment (the command line's
        --config); by default the one `GATEWAY_CONFIG` names, if any."""
        token = _CONFIG_FILE.set(_config_file)
        try:
            super().__init__(**values)
        finally:
            _CONFIG_FILE.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The flags (given as keyword arguments) over the environment over the configuration file."""
        path = _CONFIG_FILE.get() or os.environ.get(CONFIG_VARIABLE)
        return (init_settings, env_settings, *((ConfigFile(settings_cls, path),) if path else ()))

    # -- server ---------------------------------------------------------------------------------------------
    host: str = Field(
        default="127.0.0.1",
        description="Address to listen on: 0.0.0.0 (or ::) to take calls from other hosts (then see the "
        "security settings).",
        json_schema_extra=_in(Group.SERVER),
    )
    port: int = Field(
        default=8100, ge=0, le=65535, description="Port to listen on.", json_schema_extra=_in(Group.SERVER)
    )
    public_url: str | None = Field(
        default=None,
        description="The gateway's base URL as the agents reach it (e.g. http://10.0.0.5:8100, or a proxy's "
        "https://gateway.example.com): POST /rollouts answers each rollout's base_url under it "
        "(PUBLIC_URL/rollouts/ID/v1), which the environment hands its agent. Unset: the URL the POST "
        "/rollouts request itself came to, right only when the agents reach the gateway at the same "
        "address as the environment does (not behind a proxy, a port mapping or another network's name).",
        json_schema_extra=_in(Group.SERVER),
    )
    mode: Mode = Field(
        default=Mode.PASSTHROUGH,
        description="exact: splice each turn's prompt onto the exact ids of the turn it extends (needs "
        "vLLM's --enable-scale-out); passthrough: let vLLM render every prompt. Rollouts can override it.",
        json_schema_extra=_in(Group.SERVER),
    )
    local_render: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="Exact mode renders prompts in the gateway with vLLM's own renderer, built from the "
        "arguments the backend got from `vllm serve` (the model, then those that shape a render: "
        "--served-model-name, --chat-template, tool and reasoning parsers); one flag per model (the "
        "variable: ';' between models; the file: a list). Saves a round trip and vLLM's JSON of the "
        "prompt's ids; needs vLLM installed here and the model's tokenizer files. A model's first turn is "
        "rendered by both; the backend keeps rendering if they differ.",
        json_schema_extra=_in(Group.SERVER),
    )
    shutdown_timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds a stopping process (SIGTERM) gives its calls in flight to finish, after it "
        "has stopped taking new connections; the calls still running then are cut, each stored as a "
        "cancelled turn with what it had generated. Unset: it waits for every call, however long: set it "
        "below the grace period of whatever stops the gateway (Kubernetes' terminationGracePeriodSeconds, "
        "30 s by default), whose SIGKILL would leave the calls it cuts unrecorded.",
        json_schema_extra=_in(Group.SERVER),
    )
    # -- backends -------------------------------------------------------------------------------------------
    backend: Annotated[list[str], NoDecode] = Field(
        default=["http://127.0.0.1:8000"],
        description="vLLM server base URL; repeat the flag (the variable: comma-separated; the file: a list) "
        "for several. No user info: the gateway's credentials are --backend-api-key.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    backend_file: str | None = Field(
        default=None,
        description="File listing vLLM server URLs, one a line (# starts a comment), instead of --backend; "
        "re-read when it changes: new servers join, servers no longer listed leave.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    health_interval: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between health checks of each backend (/health, /v1/models, /metrics); two "
        "failed checks in a row eject a server, one passing check re-admits it.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    backend_timeout: float = Field(
        default=600.0,
        description="Seconds to wait for a backend reply, the wait for a prompt computed ahead of it "
        "(--leader-first) included.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    connect_timeout: float = Field(
        default=5.0,
        description="Seconds to wait for a backend connection.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    placement: PlacementPolicy = Field(
        default=PlacementPolicy.GROUP,
        description="Where a new rollout goes. group: beside its GRPO group's members (their shared prompt "
        "is in that server's prefix cache) while that server holds no more than 1.25 times the mean load, "
        "counting a group declared with a size whole; load: the least loaded server, each rollout alone.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    kv_events: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="Where the servers publish their KV-cache events (vLLM's --kv-events-config with "
        "enable_kv_cache_events and the zmq publisher): `tcp://{host}:5557` for every server ({host}: the "
        "server's host), or `URL=ENDPOINT` for one; repeat the flag (the variable: comma-separated) for "
        "several. The gateway then knows which blocks each server's prefix cache holds, evictions included, "
        "and a rollout that must move goes where most of its history is; without, it knows only the ids of "
        "the calls it sent each server.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    lora_policy: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="A LoRA policy: `NAME=BASE`, an adapter the servers of the model BASE serve, which "
        "agents ask for as `model: NAME`; repeat the flag (the variable: comma-separated) for several. Its "
        "versions are published with POST /admin/adapters; each call runs on the live one and its turn "
        "records it.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    lora_keep: int = Field(
        default=2,
        ge=1,
        description="Versions of each LoRA policy kept loaded on the servers, the live one included; older "
        "ones are unloaded once no call holds them. The servers' --max-loras should hold every policy's "
        "window (policies times this).",
        json_schema_extra=_in(Group.BACKENDS),
    )
    leader_first: bool = Field(
        default=True,
        description="The first call of a rollout in a declared group (group_size over 1) has its server "
        "compute its prompt first (a copy asking for one token) while the same prompt's calls from its "
        "siblings wait for it: the group's shared prompt is computed once per server, not once per member. "
        "Costs the first member one decoded token and a round trip.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    pause_clear_cache: bool = Field(
        default=True,
        description="Whether an admin pause that does not say drops the servers' KV and prefix caches "
        "(vLLM's clear_cache): exact, but after each weight update every prompt is computed again, in keep "
        "mode those of the calls in flight too. False keeps them: no prefill is redone, and the calls in "
        "flight and later calls sharing cached prefixes attend to keys and values of the previous weights "
        "(turns that spanned the update record cache_kept).",
        json_schema_extra=_in(Group.BACKENDS),
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="Calls each backend takes at once (one connection each); more wait in a queue.",
        json_schema_extra=_in(Group.BACKENDS),
    )
    max_queued: int = Field(
        default=4096,
        ge=0,
        description="Calls that may wait for a backend connection or for the prompt their group's first "
        "call computes (--leader-first), all backends together; past that, a call is answered 503 with "
        "retry-after (clients retry it).",
        json_schema_extra=_in(Group.BACKENDS),
    )
    backend_api_key: SecretStr | None = Field(
        default=None,
        description="Bearer token the gateway sends to its backends (vLLM's --api-key).",
        json_schema_extra=_in(Group.BACKENDS),
    )
    # -- store ----------------------------------------------------------------------------------------------
    db: str = Field(
        default="sqlite:///gateway.db",
        description="Database URL of the store: sqlite:///PATH (one gateway process) or "
        "postgresql://USER@HOST/DB (the postgres extra; several processes or hosts). An empty database "
        "gets the schema at start; one at an older schema needs `gateway db upgrade`.",
        json_schema_extra=_in(Group.STORE),
    )
    policy_version: str = Field(
        default="0",
        description="Policy (weights) version stamped on new turns until POST /admin/policy_version sets "
        "another.",
        json_schema_extra=_in(Group.STORE),
    )
    # -- limits and sampling --------------------------------------------------------------------------------
    max_turns: int | None = Field(
        default=None,
        ge=1,
        description="Default limit of model calls per rollout (POST /rollouts limits override).",
        json_schema_extra=_in(Group.LIMITS),
    )
    max_context_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Default limit of prompt + completion tokens of one call (POST /rollouts limits "
        "override).",
        json_schema_extra=_in(Group.LIMITS),
    )
    sampling: Sampling | None = Field(
        default=None,
        description="vLLM sampling fields imposed on every agent call (temperature, top_p, top_k, seed, "
        "structured_outputs, ...; max_tokens caps the agent's own), a JSON object (the file: a mapping); "
        "POST /rollouts sampling overrides them field by field.",
        json_schema_extra=_in(Group.LIMITS),
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        description="Largest accepted request body.",
        json_schema_extra=_in(Group.LIMITS),
    )
    pause_timeout: float = Field(
        default=600.0,
        description="Seconds a new agent call waits while the gateway is paused before a 503.",
        json_schema_extra=_in(Group.LIMITS),
    )
    rollout_idle_timeout: float = Field(
        default=4 * 3600.0,
        ge=0,
        description="Seconds a running rollout may go without a model call or a control request (its "
        "creation, a reward) before the gateway expires it: it ends with status expired, stops counting "
        "in its server's load and in the rollouts running, takes no more calls (409 rollout_expired) and "
        "trains as a failed member of its group. For environments that crash without finishing their "
        "rollouts; set it well above an agent's longest step between two calls. 0: never.",
        json_schema_extra=_in(Group.LIMITS),
    )
    # -- security -------------------------------------------------------------------------------------------
    control_token: SecretStr | None = Field(
        default=None,
        description="Bearer token the control API (/rollouts: create, reward, finish, read) requires; "
        "no token: it is open to anyone who reaches the gateway.",
        json_schema_extra=_in(Group.SECURITY),
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bearer token the /admin API requires; default: the control token; neither: it is open.",
        json_schema_extra=_in(Group.SECURITY),
    )
    rollout_keys: bool = Field(
        default=False,
        description="POST /rollouts answers a random api_key per rollout; that rollout's agent calls need it "
        "as their bearer token (the OpenAI SDK's api_key), and no other key opens them.",
        json_schema_extra=_in(Group.SECURITY),
    )
    require_registered_rollouts: bool = Field(
        default=False,
        description="Answer 404 to agent calls on rollout ids not created with POST /rollouts.",
        json_schema_extra=_in(Group.SECURITY),
    )
    # -- observability --------------------------------------------------------------------------------------
    log_level: LogLevel = Field(
        default=LogLevel.INFO,
        description="Least severe log lines written (to standard error).",
        json_schema_extra=_in(Group.OBSERVABILITY),
    )
    log_format: LogFormat = Field(
        default=LogFormat.TEXT,
        description="text: lines for a terminal; json: one JSON object a line (time, level, logger, message, "
        "replica, pid, rollout, exc), uvicorn's lines and each worker's included.",
        json_schema_extra=_in(Group.OBSERVABILITY),
    )
    access_log: bool = Field(
        default=True,
        description="Log one info line per HTTP call (gateway.access): method, path, status, latency to the "
        "last byte, rollout.",
        json_schema_extra=_in(Group.OBSERVABILITY),
    )
    access_log_probes: bool = Field(
        default=False,
        description="Also log the health probes (/healthz, /readyz) and the /metrics scrapes in the access "
        "log: left out unless asked, they would outnumber the calls.",
        json_schema_extra=_in(Group.OBSERVABILITY),
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces URL of an OpenTelemetry collector (e.g. "
        "http://collector:4318/v1/traces): each turn becomes a span (GenAI semantic conventions), sent "
        "there; needs the otel extra. Unset: no traces.",
        json_schema_extra=_in(Group.OBSERVABILITY),
    )
    # -- processes (after db: their checks read it) ---------------------------------------------------------
    workers: int = Field(
        default=1,
        ge=1,
        description="Gateway processes sharing the port (PostgreSQL only): more throughput on more cores; "
        "like replicas on other hosts, they share the run state through the store.",
        json_schema_extra=_in(Group.PROCESSES),
    )
    heartbeat_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between a process's heartbeats in the store (PostgreSQL): each also picks up "
        "a fleet change whose notification it missed.",
        json_schema_extra=_in(Group.PROCESSES),
    )
    process_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds without a heartbeat after which a gateway process is taken for dead "
        "(PostgreSQL): admin changes and pauses stop waiting for it. A process that cannot reach the store "
        "for half this time answers agent calls 503 until it can.",
        json_schema_extra=_in(Group.PROCESSES),
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

    @field_validator("public_url")
    @classmethod
    def _reachable_url(cls, value: str | None) -> str | None:
        """Every rollout's base_url starts with it: a typo here reaches no agent."""
        if value is not None:
            url = urlsplit(value)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError("not an http(s) URL (e.g. http://10.0.0.5:8100)")
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
            return [without_user_info(str(v).strip().rstrip("/")) for v in value]
        return value

    @field_validator("lora_policy", mode="before")
    @classmethod
    def _split_lora_policies(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            value = [str(v).strip() for v in value]
            names = [entry.partition("=")[0] for entry in value]
            for entry in value:
                name, _, base = entry.partition("=")
                if not _NAME.fullmatch(name) or not base:
                    raise ValueError(f"{entry!r}: not NAME=BASE (a policy name without '@', ',' or '=')")
                if name == base:
                    raise ValueError(f"{entry!r}: a LoRA policy is served on another model than itself")
                if names.count(name) > 1:
                    raise ValueError(f"{name!r}: named twice")
        return value

    @property
    def lora_bases(self) -> dict[str, str]:
        """Each LoRA policy's base model."""
        return {name: base for name, _, base in (entry.partition("=") for entry in self.lora_policy)}

    @field_validator("kv_events", mode="before")
    @classmethod
    def _split_kv_events(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            value = [str(v).strip() for v in value]
            for entry in value:
                if not _zmq_endpoint(entry.rpartition("=")[2]):
                    raise ValueError(
                        f"{entry!r}: not a ZMQ endpoint (tcp://HOST:PORT or ipc://PATH), alone or after URL="
                    )
        return value


_NAME = re.compile(r"[^\x00-\x20\x7f@,=]{1,64}")
"""A LoRA policy's name: what agents send as `model`, and the first part of its versions' names."""
_TCP = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")
_IPC = re.compile(r"ipc://[^\x00-\x1f\x7f]+")


def _zmq_endpoint(endpoint: str) -> bool:
    """Whether ZMQ can connect to `endpoint` (`{host}` standing for a server's host), checked as settings are
    read: ZMQ refuses a malformed one only once a server's events are read."""
    endpoint = endpoint.replace("{host}", "host")
    tcp = _TCP.fullmatch(endpoint)
    if tcp is not None:
        return 0 < int(tcp[1]) < 65536
    return _IPC.fullmatch(endpoint) is not None


_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}
"""What YAML makes of a file that is no mapping, in words."""


class ConfigFile(YamlConfigSettingsSource):
    """A YAML mapping of settings by their names (`max-turns` for `max_turns` too): lists as YAML lists,
    `sampling` as a mapping. What the gateway cannot use is refused in one line naming the file and the key:
    a missing file, YAML that does not parse, a file that is no mapping, an unknown setting."""

    def __init__(self, settings_cls: type[BaseSettings], path: str) -> None:
        if not Path(path).is_file():
            raise ConfigFileError(
                f"{path}: no such file" if not Path(path).exists() else f"{path}: not a file"
            )
        self._path, self._names = path, list(settings_cls.model_fields)
        super().__init__(settings_cls, yaml_file=path)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            data = yaml.safe_load(Path(file_path).read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigFileError(f"{self._path}: {where}not YAML: {problem}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigFileError(f"{self._path}: cannot be read: {exc}") from None
        if data is None:  # an empty file, or only comments
            return {}
        if not isinstance(data, dict):
            kind = _KINDS.get(type(data), type(data).__name__)
            raise ConfigFileError(
                f"{self._path}: not a mapping of settings (`name: value` lines) but a {kind}"
            )
        return self._settings(data)

    def _settings(self, data: dict[Any, Any]) -> dict[str, Any]:
        """The file's settings by their field names; an unknown or twice-given name is refused."""
        settings: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in self._names:
                close = difflib.get_close_matches(name, self._names, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigFileError(f"{self._path}: {key}: unknown setting{hint}")
            if name in settings:
                raise ConfigFileError(f"{self._path}: {key}: given twice")
            settings[name] = value
        return settings
