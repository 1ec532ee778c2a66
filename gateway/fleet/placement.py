"""Which server each rollout's calls go to: its pin while that server can serve, else a new one, chosen by
load (`gateway.fleet.routing`) and agreed through the store (`gateway.store.pins`), so that every gateway
process sends a rollout's calls to the same server (its prefix cache holds the rollout's history). The load
a new pin is chosen by is the store's count of running rollouts on each server, taken in the transaction
that pins it, by group: the members of a group starting together, through any processes, see each other and
join their group's server while it holds no more than its share (`gateway.fleet.routing`). A rollout that
moves goes where the servers' caches hold most of its history, as `gateway.fleet.prefixes` knows them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Protocol

import numpy as np

from gateway.fleet.adapters import FleetAdapters
from gateway.fleet.prefixes import PrefixIndex
from gateway.fleet.replies import BackendFailure
from gateway.fleet.routing import Reason, choose, place, usable
from gateway.fleet.servers import Server
from gateway.store.pins import MOVES, Loads, Pick, Pin


class PinStore(Protocol):
    """The store's pins (`gateway.store.Store`)."""

    async def pin(
        self, rollout_id: str, pick: Pick, usable: Collection[str], cached: dict[str, int] | None = None
    ) -> Pin | str:
        """The rollout's pin, set by compare-and-set with the server `pick` chooses by the store's counts
        (in the store's transaction) where its stored one is not `usable`; MOVES where that one must be left
        and `cached` was not given (`gateway.store.pins`)."""
        ...

    async def history(self, rollout_id: str) -> np.ndarray | None:
        """The ids of the rollout's last answered turn, which the servers' caches may hold."""
        ...


Placed = Callable[[Reason], None]
"""Told why each rollout this process pinned went where it did (the app counts them)."""

_PINS_KEPT = 100_000
"""Pins remembered in memory (the store holds them all)."""


class Placement:
    def __init__(
        self,
        servers: dict[str, Server],
        prefixes: PrefixIndex,
        pin_store: PinStore | None,
        *,
        by_group: bool = True,
        placed: Placed = lambda _reason: None,
        adapters: FleetAdapters | None = None,
    ) -> None:
        self.servers = servers
        self.adapters = adapters or FleetAdapters()
        """Which models are LoRA versions: their histories are looked up under their own keys."""
        self.prefixes = prefixes
        self.pin_store = pin_store
        """Shares pins through the store; without it pins live in this process only."""
        self.by_group = by_group
        """Whether a rollout joins its group's server (else every rollout is placed by load alone)."""
        self.placed = placed
        self._pins: OrderedDict[str, tuple[str, bool]] = OrderedDict()
        """Rollout -> (its server, whether this process placed it there: those it adds to `pinned` until a
        heartbeat brings the store's count, `gateway.replicas.shared`)."""

    async def route(self, rollout_id: str, model: str | None) -> tuple[Server, str | None]:
        """The rollout's server, and the server it left if it moved. A model no server lists goes where any
        model goes: the server's own answer (a 404) is the agent's; but never to a server that failed to load
        it (an adapter version)."""
        asked = model
        known = (model in s.models or model in s.adapter_errors for s in self.servers.values())
        if model is not None and not any(known):
            model = None
        pinned = self._pins.get(rollout_id)
        server = self.servers.get(pinned[0]) if pinned is not None else None
        if server is not None and usable(server, model):
            self._pins.move_to_end(rollout_id)
            return server, None
        candidate = choose(self.servers.values(), rollout_id, model)
        if candidate is None:
            raise BackendFailure("unreachable", _none_for(asked, self.servers.values()))
        keep = [s.url for s in self.servers.values() if usable(s, model)]
        if self.pin_store is None:
            url, left, placed = candidate.url, pinned[0] if pinned else None, True
        else:
            servers = [replace(s) for s in self.servers.values()]  # as they are now, for the store's thread
            reason = Reason.LOAD

            def pick(loads: Loads) -> str:
                """The choice by the store's loads (in the store's writer thread, in its transaction): a
                few comparisons per server, on copies of this loop's state."""
                nonlocal reason
                loaded = [replace(s, pinned=loads.servers.get(s.url, 0)) for s in servers]
                if self.by_group:
                    found = place(
                        loaded, loads.group_id, model, loads.group, loads.adds, loads.cached, loads.seats
                    )
                else:
                    found = place(loaded, rollout_id, model, cached=loads.cached)
                if found is None:
                    return candidate.url
                reason = found[1]
                return found[0].url

            answer = await self.pin_store.pin(rollout_id, pick, keep)
            if answer == MOVES:
                cached = await self._cached(self.pin_store, rollout_id, model)
                answer = await self.pin_store.pin(rollout_id, pick, keep, cached)
            assert isinstance(answer, Pin), "a pin asked with what the caches hold is set"
            url, left, placed = answer
            if placed:
                self.placed(reason)
        server = self.servers.get(url, candidate)
        self._remember(rollout_id, server.url, placed)
        return server, left if left != server.url else None

    async def _cached(self, pins: PinStore, rollout_id: str, model: str | None) -> dict[str, int]:
        """How many ids of the rollout's history each server's cache holds, as its weights computed them."""
        history = await pins.history(rollout_id)
        if history is None:
            return {}
        return self.prefixes.cached(history, list(self.servers), self.adapters.key(model))

    def _remember(self, rollout_id: str, url: str, placed: bool) -> None:
        known = self._pins.get(rollout_id)
        if known is not None and known[0] == url:  # two calls of one rollout placed it at once: count it once
            if placed and not known[1]:
                self._pins[rollout_id] = (url, True)
                self.servers[url].pinned += 1
            self._pins.move_to_end(rollout_id)
            return
        self.forget(rollout_id)
        self._pins[rollout_id] = (url, placed)
        if placed:
            self.servers[url].pinned += 1
        if len(self._pins) > _PINS_KEPT:
            self.forget(next(iter(self._pins)))

    def forget(self, rollout_id: str) -> None:
        """The rollout is over (or moved): it no longer counts on its server."""
        pin = self._pins.pop(rollout_id, None)
        if pin is not None and pin[1] and pin[0] in self.servers:
            self.servers[pin[0]].pinned -= 1


def _none_for(model: str | None, servers: Iterable[Server]) -> str:
    listed = ", ".join(f"{s.url} ({_standing(s, model)})" for s in servers)
    return f"no healthy backend takes new rollouts for model {model!r}: {listed}"


def _standing(server: Server, model: str | None) -> str:
    if server.draining:
        return "draining"
    if model in server.adapter_errors:
        return "failed to load it"
    return "healthy" if server.healthy else "ejected"
