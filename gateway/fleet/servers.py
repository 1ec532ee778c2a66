"""What the gateway knows of each vLLM server: health, the models it serves, its load and its record."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from rollout_store.database import redacted


def without_user_info(url: str) -> str:
    """`url` if it names no user: the engine client never sends a URL's user info, and a server's URL is its
    name in logs, metrics, the admin state and every turn's record, where a password must not go. The
    gateway's own credentials are `--backend-api-key`."""
    if urlsplit(url).username is not None:
        raise ValueError(
            f"{redacted(url)}: a backend URL's user info is not sent to the server; give the gateway's "
            "credentials with --backend-api-key (vLLM's --api-key)"
        )
    return url


@dataclass
class Server:
    url: str
    healthy: bool = True
    """As the run state says (`gateway.replicas.publish`): false once the leading process's checks failed
    `eject_after` times in a row, or a call could not connect; true again after one passing check."""
    draining: bool = False
    """Takes no new rollout; the rollouts pinned to it finish there."""
    models: frozenset[str] = frozenset()
    """Model names from its /v1/models (empty until known)."""
    in_flight: int = 0
    pinned: int = 0
    """Running rollouts pinned to it: the store's count at the last heartbeat (PostgreSQL), with those this
    process placed since."""
    failed_checks: int = 0
    """Health checks failed in a row (counted by the process that checks)."""
    requests: int = 0
    errors: int = 0
    answered: int = 0
    """Calls whose reply's headers arrived."""
    latency_total: float = 0.0
    """Their seconds to the headers, summed."""
    latency_ewma: float | None = None
    """Seconds to the reply's headers, smoothed over recent calls."""
    prefix_cache_hit_rate: float | None = None
    """From the server's own /metrics: prefix-cache hits over queries, since it started."""
    reloads: int = 0
    """The fleet's weight reloads it has done (`Fleet.weights` when current)."""
    weight_version: str | None = None
    """The weight version it was given (None: never)."""
    adapter_errors: dict[str, str] = field(default_factory=dict)
    """Adapter versions it failed to load, and why: it serves none of their policy's calls until a retry
    loads them."""
    max_loras: int | None = None
    """Adapters its batches hold (vLLM's --max-loras, from its /metrics), once a check read it."""
    scale_out: bool | None = None
    weight_spans: bool | None = None
    """Whether its replies carry each token's weight version (the project's vLLM plugin), once a health check
    asked it."""
    """Whether it serves vLLM's token-in/token-out endpoints (exact mode), once known."""
    added_at: float = field(default=0.0)

    def serves(self, model: str | None) -> bool:
        """Unknown models (or none yet listed) go anywhere: the server's own answer is the agent's. An adapter
        version it failed to load does not, listed or not: it would answer that the model does not exist."""
        if model is None:
            return True
        return model not in self.adapter_errors and (not self.models or model in self.models)

    def took(self, seconds: float) -> None:
        self.answered += 1
        self.latency_total += seconds
        self.latency_ewma = seconds if self.latency_ewma is None else 0.8 * self.latency_ewma + 0.2 * seconds

    def view(self) -> dict[str, object]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "pinned": self.pinned,
            "models": sorted(self.models),
            "requests": self.requests,
            "errors": self.errors,
            "latency_ms": round(self.latency_ewma * 1000, 2) if self.latency_ewma is not None else None,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "weight_spans": self.weight_spans,
            "weight_version": self.weight_version,
            "reloads": self.reloads,
            "adapter_errors": dict(self.adapter_errors),
        }
