"""This process of the gateway as a replica: what it holds of the run state, how it changes it, and what it
reports of itself.

A `Replica` is one of two: a `LocalReplica` on SQLite, where the gateway is one process and its changes apply
here with nothing to follow, and a `SharedReplica` on PostgreSQL (`gateway.replicas.shared`), where the run
state lives in the store and every process follows it. The app builds the one its store calls for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import generate_latest

from gateway import logs
from gateway.fleet.fleet import Fleet
from gateway.metrics import Metrics, Samples
from gateway.replicas.apply import adopt, held_by
from gateway.replicas.facts import RunFacts
from gateway.store.processes import ProcessIdentity, ProcessReport, ProcessRow, ServerLoad
from gateway.store.run_state import RunState
from gateway.store.store import Store
from gateway.turns.recording import Recorder
from gateway.turns.traffic import Traffic

log = logging.getLogger(__name__)

_POLL = 0.02
"""Seconds between reads of the processes while waiting for them."""


class Replica(ABC):
    """This process of the gateway: what it holds of the run state, and what it reports of itself."""

    leads: bool
    """Whether this process checks the servers' health for the gateway (one process does)."""

    def __init__(
        self,
        identity: ProcessIdentity,
        store: Store,
        fleet: Fleet,
        traffic: Traffic,
        recorder: Recorder,
        metrics: Metrics,
        *,
        timeout: float,
    ) -> None:
        self.identity = identity
        self._store, self._fleet, self._traffic = store, fleet, traffic
        self._recorder, self._metrics = recorder, metrics
        self.timeout = timeout
        """Seconds without a heartbeat after which a process is dead (`--process-timeout`)."""
        logs.name_replica(identity.process_id)  # every log line of this process says which replica wrote it
        self.held = held_by(fleet, traffic, recorder)
        self.facts = RunFacts(lambda: self.leads, store, fleet, traffic, recorder)
        metrics.registry.register(self.facts)
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def process_id(self) -> str:
        return self.identity.process_id

    @abstractmethod
    async def start(self) -> None:
        """Take the run state this process serves under, and follow it."""

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- changes ------------------------------------------------------------------------------------------

    @abstractmethod
    async def change(self, edit: Callable[[RunState], None], *, wait: bool = True) -> RunState:
        """Make the next run state (`edit` applied to the current one) and, with `wait`, return once every
        live process holds it. `edit` raises to refuse the change (KeyError, ValueError), which then changes
        nothing; an edit that changes nothing makes no new run state."""

    def adopt_if_newer(self, state: RunState | None) -> None:
        """Hold `state` unless this process already holds a newer one."""
        if state is None or state.epoch <= self.held.epoch:
            return
        self.held = state
        adopt(state, self._fleet, self._traffic, self._recorder)

    # -- the processes ------------------------------------------------------------------------------------

    @abstractmethod
    async def processes(self) -> list[ProcessRow]:
        """Every registered process, this one first with its numbers as they are now."""

    def _mine(self, started_at: float = 0.0) -> ProcessRow:
        """This process's row with its numbers as they are now (`started_at` as the store recorded it)."""
        times = {"started_at": started_at, "heartbeat_age": 0.0}
        return ProcessRow.model_validate(self._report().model_dump() | self.identity.columns() | times)

    async def alive(self) -> list[ProcessRow]:
        return [row for row in await self.processes() if row.heartbeat_age < self.timeout]

    async def until(self, done: Callable[[list[ProcessRow]], bool], timeout: float) -> bool:
        """Wait until `done` holds of the live processes; False if it still does not after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not done(await self.alive()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL)
        return True

    async def exposition(self) -> bytes:
        """Its metrics in Prometheus text."""
        await self.facts.refresh()
        return generate_latest(self._metrics.registry)

    def confirmed(self) -> bool:
        """Whether this process has confirmed the run state with the store recently enough to serve."""
        return self.unconfirmed() is None

    @abstractmethod
    def unconfirmed(self) -> str | None:
        """Why this process serves no agent call now (the store out of reach), or None."""

    def _report(self, metrics: Samples | None = None) -> ProcessReport:
        traffic = self._traffic
        return ProcessReport(
            applied_epoch=self.held.epoch,
            in_flight=traffic.in_flight,
            waiting=traffic.waiting,
            ended=traffic.ended,
            loads={  # a copy first: the heartbeat thread reads it while the loop may add a server
                s.url: ServerLoad(in_flight=s.in_flight, requests=s.requests, errors=s.errors)
                for s in list(self._fleet.servers.values())
            },
            adapter_holds=dict(self._fleet.adapters.holds),
            metrics=metrics,
        )

    # -- work in the background -----------------------------------------------------------------------------

    def run_in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` in the background, held until done (closing cancels it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("replica work in the background failed: %r", task.exception())


class LocalReplica(Replica):
    """The gateway's one process (SQLite): it holds the run state in memory, and changes apply here alone."""

    leads = True

    async def start(self) -> None:
        """Nothing to join: the run state is the one this process was built with."""

    async def change(self, edit: Callable[[RunState], None], *, wait: bool = True) -> RunState:
        state = self.held.model_copy(deep=True)
        edit(state)
        if state != self.held:
            state.epoch = self.held.epoch + 1
            self.adopt_if_newer(state)
        return self.held

    async def processes(self) -> list[ProcessRow]:
        return [self._mine()]

    def unconfirmed(self) -> str | None:
        return None
