"""Request and response models of the admin API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field

from gateway.encoding import RequestModel
from gateway.fleet.servers import without_user_info


class PauseRequest(RequestModel):
    mode: Literal["wait", "abort", "keep"] = "wait"
    """wait: let calls in flight finish; abort: have vLLM abort them (they are recorded, finish_reason abort);
    keep: freeze them inside vLLM until resume (they then span the weight update). With abort and keep, calls
    that reach vLLM after it paused are queued there and run after resume."""
    timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0
    """Seconds to wait for calls in flight to finish (wait); a finite number, so that a pause ends."""
    clear_cache: Annotated[bool, Field(strict=True)] | None = None
    """Whether the servers drop their KV and prefix caches as they pause (vLLM's `clear_cache`): the calls
    after the update compute their prompts again with the new weights, and in keep mode the calls in flight
    are computed again too (vLLM preempts them). False keeps the caches: no prefill is redone, and the calls
    in flight, and later calls that share cached prefixes, attend to keys and values of the previous weights.
    Unset: `--pause-clear-cache`."""


class PolicyVersionRequest(RequestModel):
    version: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$")]
    """A label of the weights (no control characters: PostgreSQL's text takes no NUL)."""


class AdapterRequest(RequestModel):
    policy: Annotated[str, Field(min_length=1, max_length=64)]
    """A LoRA policy of the gateway (--lora-policy NAME=BASE)."""
    version: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x20\x7f]+$")]
    """Its new version's label: recorded with every turn it samples (no spaces or control characters)."""
    path: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]+$")]
    """The adapter's directory (PEFT's format), as every server reads it: one of its own for each version,
    never written again."""


class BackendRequest(RequestModel):
    url: Annotated[
        str, Field(pattern=r"^https?://[!-.0-~][!-~]*$", max_length=256), AfterValidator(without_user_info)
    ]
    """A vLLM server's base URL, as --backend takes it: printable ASCII, no space, no user info."""


class BackendView(BaseModel):
    """A vLLM server as the gateway sees it."""

    url: str
    healthy: bool
    """False once health checks failed twice in a row or a connection could not be made: it takes no calls."""
    draining: bool
    """Takes no new rollouts; those pinned to it finish there."""
    in_flight: int
    pinned: int
    """Running rollouts pinned to it (the store's count)."""
    models: list[str]
    requests: int
    errors: int
    latency_ms: float | None
    """Time to the reply's headers, smoothed over recent calls."""
    prefix_cache_hit_rate: float | None
    """The server's own prefix-cache hit rate (its /metrics), since it started."""
    weight_spans: bool | None
    """Whether its replies carry each token's weight version (the project's vLLM plugin, `rl-gateway-vllm`):
    its turns keep them (`weight_versions`); null until a health check asked it."""
    cached_blocks: int
    """Blocks of its prefix cache the answering process knows it holds (where a moving rollout goes)."""
    cached_known_from: Literal["events", "calls"]
    """events: its KV-cache events (`--kv-events`), exact; calls: the ids of the calls this process sent it,
    which never tell what it evicted (without `--kv-events`, before its first event is read, and while its
    events cannot be read)."""
    kv_events: Literal["reading", "down"] | None
    """Whether the answering process reads its KV-cache events: down once reading failed, while it is retried;
    None without `--kv-events` for it."""
    kv_events_error: str | None
    """Why reading its events failed, while down."""
    weight_version: str | None
    """The weight version the gateway gave it (`/admin/policy_version`); None if never given one."""
    reloads: int
    """Weight reloads it has done (`/admin/reload_weights`); a server added or re-admitted later catches up
    before it takes calls."""
    adapter_errors: dict[str, str]
    """LoRA versions it failed to load, and why: it takes none of their policy's calls until a health check
    loads them."""


class AdapterView(BaseModel):
    """A LoRA policy's version the servers hold (`POST /admin/adapters`)."""

    policy: str
    version: str
    name: str
    """Its name on the servers (vLLM's lora_name)."""
    path: str
    live: bool
    """The version its policy's new calls go to."""
    retired: bool
    """Past the keep window (--lora-keep): unloaded once no call holds it."""
    calls: int
    """Calls in flight on it, every live process's added up."""
    backends: list[str]
    """The servers that hold it."""


class WorkerView(BaseModel):
    """One process of the gateway (`--workers`, or replicas on other hosts sharing the PostgreSQL store)."""

    process_id: str
    host: str
    pid: int
    port: int
    alive: bool
    """Whether its last heartbeat is younger than --process-timeout; changes and pauses wait only for those
    alive."""
    heartbeat_age: float
    """Seconds since its last heartbeat."""
    applied_epoch: int
    """The newest run state epoch it holds."""
    in_flight: int
    waiting: int
    requests: int
    """Calls it sent to the backends."""


class AdminState(BaseModel):
    epoch: int
    """The run state is numbered: each admin change makes the next epoch, and returns once every live
    process holds it."""
    paused: bool
    pause_mode: Literal["wait", "abort", "keep"] | None
    paused_by: str | None
    """The process whose admin call paused the gateway."""
    cache_kept: bool
    """Whether the last pause kept the servers' caches."""
    in_flight: int
    waiting: int
    """Agent calls held by the pause."""
    policy_version: str
    adapters: list[AdapterView]
    backends: list[BackendView]
    workers: list[WorkerView]
    """The gateway's processes, this one first, then the others (alive or not, until an hour after their last
    heartbeat): the counts above are those of the live ones added up."""
