"""Health checks of the vLLM servers. One process checks them for the whole gateway and publishes what it
finds in the run state for every process to follow (`gateway.replicas.publish`).

A check asks /health, then (when it passes) the served models, the prefix-cache hit rate and whether the
project's vLLM plugin answers (its replies then carry each token's weight version). A server fails
`eject_after` checks in a row before it is ejected; one passing check re-admits it, once it holds the
gateway's weights: a server coming back is first given the reloads and version it missed. Checks that only
time out do not eject the last healthy server of a model: a server slow to answer under load is busy, and
without it the model's every call would fail. A call that no healthy server takes has the ejected servers
checked at once, by whichever process it reached (`EngineClient.revive`), rather than waiting for the next
round.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from gateway.fleet.adapters import Call, FleetAdapters, load
from gateway.fleet.servers import Server
from gateway.fleet.weight_versions import RELOAD, RELOAD_BODY, WEIGHT_VERSION, FleetWeights

log = logging.getLogger(__name__)

_MAX_LORA = re.compile(r'max_lora="([0-9]+)"')
PLUGIN = "/rl-gateway/plugin"
"""What the project's vLLM plugin answers (`vllm-plugin/`): its version and the fields it adds."""
_CHECK_SECONDS = 5.0
_CHECK_TIMEOUT = aiohttp.ClientTimeout(total=_CHECK_SECONDS)


@dataclass
class Found:
    """What one check found of a server: what the run state should say of it. Health and weights are
    changes, None where the check changed nothing: an ejection published while the check ran (a call that
    could not connect) is not undone by a check that began before it."""

    url: str
    models: frozenset[str]
    prefix_cache_hit_rate: float | None
    weight_spans: bool | None = None
    healthy: bool | None = None
    weights: FleetWeights | None = None
    """The weights it was given to catch up with the other servers."""
    adapters_checked: frozenset[str] = frozenset()
    """The LoRA versions the check made sure of (loaded where missing): the run state takes `models` and
    `adapter_errors` for those; a version published while the check ran is not undone by it."""
    adapter_errors: dict[str, str] = field(default_factory=dict)
    """Those of them it failed to load, and why."""


async def check(
    session: aiohttp.ClientSession,
    server: Server,
    weights: FleetWeights,
    first_version: str | None,
    adapters: FleetAdapters,
    eject_after: int,
    call: Call,
    *,
    last: bool,
    connect_timeout: float,
) -> Found:
    """One health check of `server` (its `failed_checks` count the failures in a row); `call` gives a
    returning server the weights it missed, and any server the live LoRA versions it lacks (one that
    restarted, or failed to load one before), and a server that reports weight versions the run's version
    (`first_version` before any update); `last`: no other healthy server serves one of its models."""
    was_healthy = server.healthy
    found = Found(server.url, server.models, server.prefix_cache_hit_rate, server.weight_spans)
    failure = await _failure(session, server, connect_timeout)
    if failure is not None:
        server.failed_checks += 1
        if was_healthy and server.failed_checks >= eject_after:
            if isinstance(failure, TimeoutError) and last:
                log.warning(
                    "backend %s: %d health checks timed out; kept, as the last server of its models",
                    server.url,
                    server.failed_checks,
                )
            else:
                log.warning("backend %s ejected: %d health checks failed", server.url, server.failed_checks)
                found.healthy = False
        return found
    try:  # what it serves and how its cache does: worth knowing, but not a health matter
        found.models = await _models(session, server)
        lines = await _metrics(session, server)
        rate = prefix_hit_rate(lines)
        found.prefix_cache_hit_rate = round(rate, 3) if rate is not None else None
        _check_lora_window(server, max_loras(lines), adapters)
        found.weight_spans = await _weight_spans(session, server)
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
        log.debug("backend %s: no models or metrics (%r)", server.url, exc)
    server.failed_checks = 0
    await _hold_adapters(call, server, found, adapters)
    if was_healthy:
        await _label(call, server, found, weights.version or first_version)
        return found
    missed = await _catch_up(call, server, weights)
    if missed is not None:
        log.warning("backend %s not admitted: it missed the gateway's weights (%s)", server.url, missed)
        server.failed_checks += 1
        return found
    log.info("backend %s healthy: admitted", server.url)
    found.healthy, found.weights = True, weights
    return found


async def _failure(
    session: aiohttp.ClientSession, server: Server, connect_timeout: float
) -> BaseException | str | None:
    """Why /health did not pass (a TimeoutError when it only took too long), or None."""
    timeout = aiohttp.ClientTimeout(total=_CHECK_SECONDS, sock_connect=connect_timeout)
    try:
        async with session.get(server.url + "/health", timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except Exception as exc:  # whatever stops a probe, the server is not serving
        return exc


async def _catch_up(call: Call, server: Server, weights: FleetWeights) -> str | None:
    """Give a server coming (back) into service the weight reloads and version it missed, as the others had
    them; what went wrong, or None."""
    if server.reloads < weights.reloads:
        failure = await call(server.url + RELOAD, RELOAD_BODY)
        if failure is not None:
            return failure
    if weights.version is not None and server.weight_version != weights.version:
        return await call(server.url + WEIGHT_VERSION, {"new_version": weights.version})
    return None


async def _label(call: Call, server: Server, found: Found, version: str | None) -> None:
    """Give a server in service that reports weight versions, and that this run has given none yet (at the
    gateway's start), the run's version: vLLM labels the tokens it samples with it (else with what an
    earlier run gave it, or "default"), and turns keep those labels. Later versions reach it through
    `/admin/policy_version`."""
    if not found.weight_spans or version is None or server.weight_version is not None:
        return
    failure = await call(server.url + WEIGHT_VERSION, {"new_version": version})
    if failure is None:
        found.weights = FleetWeights(server.reloads, version)
    elif not server.weight_spans:  # said once, as the plugin is found
        log.warning(
            "backend %s reports weight versions but takes none (%s): its turns' spans keep its own labels; "
            "start it with VLLM_SERVER_DEV_MODE=1",
            server.url,
            failure,
        )


async def _hold_adapters(call: Call, server: Server, found: Found, adapters: FleetAdapters) -> None:
    """Load the live LoRA versions the server serves the base of and does not list (its models, when it
    listed them; else what the run state says it holds)."""
    wanted = adapters.serving(found.models)
    found.adapters_checked = frozenset(v.name for v in wanted)
    for version in wanted:
        if version.name in found.models:
            continue
        failure = await load(call, server.url, version)
        if failure is None:
            found.models |= {version.name}
            log.info("backend %s: loaded LoRA version %s", server.url, version.name)
        else:
            found.adapter_errors[version.name] = failure
            if version.name not in server.adapter_errors:
                log.warning("backend %s cannot load LoRA version %s: %s", server.url, version.name, failure)


async def _models(session: aiohttp.ClientSession, server: Server) -> frozenset[str]:
    async with session.get(server.url + "/v1/models", timeout=_CHECK_TIMEOUT) as response:
        listed = (await response.json()).get("data") or ()
    return frozenset(str(m.get("id")) for m in listed if isinstance(m, dict))


async def _weight_spans(session: aiohttp.ClientSession, server: Server) -> bool:
    """Whether the server has the project's vLLM plugin, adding weight-version spans to its replies."""
    async with session.get(server.url + PLUGIN, timeout=_CHECK_TIMEOUT) as response:
        if response.status != 200:
            return False
        described = await response.json()
    fields = described.get("fields") if isinstance(described, dict) else None
    spans = isinstance(fields, list) and "weight_versions" in fields
    if spans != server.weight_spans:
        log.info("backend %s %s weight-version spans", server.url, "reports" if spans else "does not report")
    return spans


async def _metrics(session: aiohttp.ClientSession, server: Server) -> list[str]:
    """The server's Prometheus text, by line (none if it has no /metrics)."""
    async with session.get(server.url + "/metrics", timeout=_CHECK_TIMEOUT) as response:
        if response.status != 200:
            return []
        return (await response.text()).splitlines()


def max_loras(lines: Iterable[str]) -> int | None:
    """vLLM's --max-loras, from its `vllm:lora_requests_info` series (None without LoRA)."""
    for line in lines:
        if line.startswith("vllm:lora_requests_info{"):
            found = _MAX_LORA.search(line)
            if found is not None:
                return int(found[1])
    return None


def _check_lora_window(server: Server, slots: int | None, adapters: FleetAdapters) -> None:
    """Say once per server when its batches hold fewer adapters than the gateway keeps loaded: calls on the
    others would wait for a slot."""
    window = len(adapters.bases) * adapters.keep
    if slots is not None and slots < window and server.max_loras != slots:
        log.warning(
            "backend %s batches %d adapters (--max-loras) but the gateway keeps %d loaded (%d LoRA policies "
            "times --lora-keep %d): calls on the others wait for a slot",
            server.url,
            slots,
            window,
            len(adapters.bases),
            adapters.keep,
        )
    server.max_loras = slots


def prefix_hit_rate(lines: Iterable[str]) -> float | None:
    """vLLM's prefix-cache hit rate from its Prometheus text: hits over queries (in tokens), summed over its
    engines; None before any query."""
    totals = {"hits": 0.0, "queries": 0.0}
    for line in lines:
        if line.startswith("vllm:prefix_cache_"):
            name, _, value = line.rpartition(" ")
            for kind in totals:
                if name.startswith(f"vllm:prefix_cache_{kind}_total"):
                    totals[kind] += float(value)
    return totals["hits"] / totals["queries"] if totals["queries"] else None
