"""The vLLM servers this process holds and what it knows of them: their health and load (`Server`), which
server each rollout is pinned to (`gateway.fleet.placement`), the groups' prompts computed ahead
(`gateway.fleet.leaders`), the fleet's weights, and what each server's prefix cache holds (read from the
servers' KV-cache events with --kv-events). `gateway.replicas.apply` keeps the servers as the run state says;
calls reach them through `gateway.fleet.engine`, which routes through the fleet. The LoRA policies' adapters
(`gateway.fleet.adapters`) are part of it: a server serves a version once its models list the version's
name."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.fleet.adapters import FleetAdapters
from gateway.fleet.kv_events import KvEvents
from gateway.fleet.leaders import Leaders
from gateway.fleet.placement import PinStore, Placed, Placement
from gateway.fleet.prefixes import PrefixIndex
from gateway.fleet.servers import Server
from gateway.fleet.weight_versions import FleetWeights

log = logging.getLogger(__name__)


class Fleet:
    def __init__(
        self,
        urls: list[str],
        *,
        left: Callable[[str], None],
        pins: PinStore | None = None,
        by_group: bool = True,
        placed: Placed = lambda _reason: None,
        kv_events: list[str] | None = None,
        lora_bases: dict[str, str] | None = None,
        lora_keep: int = 2,
        adapter_freed: Callable[[], None] = lambda: None,
        first_version: str | None = None,
    ) -> None:
        """`left`: told of each server that leaves (the engine client closes its idle connections to it).
        `pins`, `by_group`, `placed`: how rollouts are placed (`Placement`). `kv_events`: the servers'
        KV-cache event endpoints to read (--kv-events). `lora_bases`, `lora_keep`: each LoRA policy's base
        model (--lora-policy) and the versions of each kept loaded (--lora-keep); `adapter_freed`: told when
        this process's last call on a retired version ended. `first_version`: the run's policy version before
        any update, which servers that report weight versions label their tokens with until the first."""
        if not urls:
            raise ValueError("at least one backend URL is required")
        self._left = left
        self.servers: dict[str, Server] = {}
        self.prefixes = PrefixIndex()
        """What each server's prefix cache holds (a moving rollout goes where most of its history is)."""
        self.events = KvEvents(self.prefixes, kv_events) if kv_events else None
        """Reads the servers' KV-cache events into `prefixes`, those of servers that join later too."""
        for url in urls:
            self.add(url, healthy=True)
        self.adapters = FleetAdapters(dict(lora_bases or {}), lora_keep, freed=adapter_freed)
        self.placement = Placement(
            self.servers, self.prefixes, pins, by_group=by_group, placed=placed, adapters=self.adapters
        )
        self.leaders = Leaders()
        self.weights = FleetWeights()
        self.first_version = first_version

    @property
    def urls(self) -> list[str]:
        return list(self.servers)

    def add(self, url: str, *, healthy: bool = False) -> Server:
        """A server this process holds; one added at run time takes calls once a health check has passed."""
        url = url.rstrip("/")
        server = self.servers.get(url)
        if server is None:
            server = self.servers[url] = Server(url, healthy, added_at=time.time())
            log.info("backend %s added", url)
            if self.events is not None:
                self.events.follow(url)
        return server

    def remove(self, url: str) -> None:
        """The server leaves: its rollouts move to others on their next call (calls in flight finish). Its
        idle connections are closed at once, the others as their calls end."""
        if self.servers.pop(url, None) is not None:
            self._left(url)
            if self.events is not None:
                self.events.leave(url)
            self.prefixes.forget(url)
            log.info("backend %s removed", url)

    async def route(self, rollout_id: str, model: str | None) -> tuple[Server, str | None]:
        """The rollout's server, pinned to it, and the server it left if it moved (`Placement.route`)."""
        return await self.placement.route(rollout_id, model)

    def forget(self, rollout_id: str) -> None:
        self.placement.forget(rollout_id)

    def last_of_a_model(self, server: Server) -> bool:
        """No other healthy server serves one of its models (or, its models unknown, no other is healthy)."""
        others = [s for s in self.servers.values() if s is not server and s.healthy]
        if not server.models:
            return not others
        return any(not any(s.serves(model) for s in others) for model in server.models)

    async def close(self) -> None:
        if self.events is not None:
            await self.events.close()
