"""Publishing a LoRA policy's version to the fleet and retiring old ones, for every process of the gateway.

A version is loaded on every healthy server of its policy's base at once; when that is done, one run state
change makes it the live version everywhere (each server's models list it, or its failure) and retires the
versions past the keep window. New calls go to the live version from then on; calls in flight finish on
theirs. A retired version is unloaded from the servers once no process has a call on it (each process
reports its calls per version with its heartbeat), then leaves the run state.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from gateway.errors import ApiError
from gateway.fleet.adapters import FleetAdapters, load, unload
from gateway.fleet.engine import Engine
from gateway.fleet.fleet import Fleet
from gateway.replicas.replica import Replica
from gateway.store.run_state import AdapterVersion, RunState

log = logging.getLogger(__name__)


async def publish(replica: Replica, fleet: Fleet, engine: Engine, version: AdapterVersion) -> None:
    """Make `version` its policy's live one; the servers that could not load it say why in their
    `adapter_errors`. Refused (nothing changes) when the policy is unknown, the version or its path is
    published already, or no server could load it."""
    adapters = fleet.adapters
    base = _base_of(adapters, version.policy)
    _refuse_repeats(adapters.versions, version)
    servers = [s for s in fleet.servers.values() if s.healthy and s.serves(base)]
    if not servers:
        raise ApiError(
            503, f"no healthy backend serves {base!r}, the base of {version.policy!r}", "no_backend"
        )
    failures = await asyncio.gather(*(load(engine.call_one, s.url, version) for s in servers))
    loaded = {s.url for s, failure in zip(servers, failures, strict=True) if failure is None}
    failed = {s.url: failure for s, failure in zip(servers, failures, strict=True) if failure is not None}
    if not loaded:
        reasons = "; ".join(failed.values())
        raise ApiError(
            502, f"no backend could load {version.name} from {version.path}: {reasons}", "not_loaded"
        )

    def published(state: RunState) -> None:
        _refuse_repeats(state.adapters, version)  # another process may have published meanwhile
        state.adapters = _retired([*state.adapters, version], version.policy, adapters.keep)
        for entry in state.servers:
            if entry.url in loaded:
                if entry.models:  # else unknown until its health check lists them: it serves any model
                    entry.models = sorted({*entry.models, version.name})
                entry.adapter_errors.pop(version.name, None)
            elif entry.url in failed:
                entry.adapter_errors[version.name] = failed[entry.url]

    await replica.change(published)
    for url, failure in failed.items():
        log.warning("backend %s cannot load LoRA version %s: %s", url, version.name, failure)
    log.info(
        "LoRA policy %s is at version %s (%d of %d backends)",
        version.policy,
        version.version,
        len(loaded),
        len(servers),
    )


def _base_of(adapters: FleetAdapters, policy: str) -> str:
    base = adapters.bases.get(policy)
    if base is None:
        named = ", ".join(adapters.bases) or "none"
        raise ApiError(
            404,
            f"{policy!r} is not a LoRA policy of the gateway (--lora-policy NAME=BASE: {named})",
            "policy_not_found",
        )
    return base


def _refuse_repeats(versions: list[AdapterVersion], version: AdapterVersion) -> None:
    """A version is published once, from a directory no other version was read from: vLLM would reuse the
    cached blocks computed with the other's weights (its cache keys hold the path)."""
    if any(v.policy == version.policy and v.version == version.version for v in versions):
        raise ApiError(409, f"{version.name} is published already", "version_exists")
    clash = next((v for v in versions if v.path == version.path), None)
    if clash is not None:
        raise ApiError(
            409,
            f"{version.path} was published as {clash.name}: publish each version from a directory of its own",
            "path_published",
        )


def _retired(versions: list[AdapterVersion], policy: str, keep: int) -> list[AdapterVersion]:
    """`versions` with the policy's older than its newest `keep` retired."""
    mine = [v for v in versions if v.policy == policy and not v.retired]
    old = {v.name for v in mine[: max(len(mine) - keep, 0)]}
    return [v.model_copy(update={"retired": True}) if v.name in old else v for v in versions]


async def release(replica: Replica, fleet: Fleet, engine: Engine) -> None:
    """Unload the retired versions no process has a call on from the healthy servers listing them, and drop
    them from the run state. One that a server failed to unload stays, retired, and is asked again next
    time; a server out of service keeps its names (unused: no call goes to a retired version)."""
    retired = [v for v in fleet.adapters.versions if v.retired]
    if not retired:
        return
    held: Counter[str] = Counter()
    for row in await replica.alive():
        held.update(row.adapter_holds)
    free = {v.name for v in retired if not held[v.name]}
    if not free:
        return
    unloaded: dict[str, set[str]] = {}
    stuck: set[str] = set()
    for server in [s for s in fleet.servers.values() if s.healthy]:
        names = sorted(free & server.models)
        failures = await asyncio.gather(*(unload(engine.call_one, server.url, name) for name in names))
        unloaded[server.url] = set()
        for name, failure in zip(names, failures, strict=True):
            if failure is None:
                unloaded[server.url].add(name)
            else:
                stuck.add(name)
                log.warning("backend %s could not unload LoRA version %s: %s", server.url, name, failure)
    done = free - stuck

    def released(state: RunState) -> None:
        state.adapters = [v for v in state.adapters if v.name not in done]
        for entry in state.servers:
            entry.models = [name for name in entry.models if name not in unloaded.get(entry.url, ())]
            for name in done:
                entry.adapter_errors.pop(name, None)

    await replica.change(released)
    for name in sorted(done):
        log.info("LoRA version %s unloaded: no call holds it", name)
