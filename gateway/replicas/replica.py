"""One gateway on many processes and hosts, each a replica: the run state lives in PostgreSQL, every process
follows it.

An admin change is one transaction on the store's run state (`gateway.store.run_state.change`), announced
with NOTIFY; the process that made it waits until every live process has applied it. Each process LISTENs,
and heartbeats once a `--heartbeat-interval` (twenty times a second while paused, so that a pause sees calls
end at once): the heartbeat records its calls in flight, loads and metrics, reads the run state's epoch, and
applies a newer one, so a missed notification costs latency, never correctness. A process whose heartbeat is
older than `--process-timeout` is dead: no change waits for it, and GET /admin/state says so.

A process that cannot reach the store for half that timeout stops admitting agent calls (503, retry): it can
no longer confirm the policy version, and the change that replaced it may already have been acknowledged
without it. It serves again by itself once a heartbeat goes through. The heartbeats that keep it serving
also run on a thread of their own: a process whose event loop lags under load is busy, not cut off from
the store, and its calls must not be refused as if it were.

On SQLite the gateway is one process: its changes apply here, with nothing to follow.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import generate_latest
from sqlalchemy.engine import make_url

from gateway import logs
from gateway.fleet.fleet import Fleet
from gateway.metrics import Metrics, exposition_with, samples
from gateway.replicas.apply import adopt, held_by
from gateway.replicas.facts import NAMES as FACTS
from gateway.replicas.facts import REFRESH, RunFacts
from gateway.settings import Settings
from gateway.store import processes as stored_processes
from gateway.store import run_state as stored
from gateway.store.processes import ProcessReport, ProcessRow, ServerLoad
from gateway.store.run_state import RunState
from gateway.store.store import Store
from gateway.turns.recording import Recorder
from gateway.turns.traffic import Traffic
from rollout_store.database import is_sqlite, normalize_url

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

T = TypeVar("T")
_PAUSED_BEAT = 0.05
"""Seconds between heartbeats while paused."""
_POLL = 0.02
"""Seconds between reads of the processes while waiting for them."""
_LEAD_LOCK = 0x726C_1EAD
"""Advisory lock the leading process holds on its listening connection (released if it dies), with its
schema's hash as the second key (`gateway.store.processes`)."""


class Replica:
    """This process of the gateway: what it holds of the run state, and what it reports of itself."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        fleet: Fleet,
        traffic: Traffic,
        recorder: Recorder,
        metrics: Metrics,
    ) -> None:
        self._store, self._fleet, self._traffic = store, fleet, traffic
        self._recorder, self._metrics = recorder, metrics
        self._db = settings.db
        self.shared = not is_sqlite(settings.db)
        """Whether the run state lives in the store (PostgreSQL), followed by every process."""
        self.interval = settings.heartbeat_interval
        self.timeout = settings.process_timeout
        self.process: dict[str, Any] = {
            "process_id": f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "port": settings.port,
        }
        logs.name_replica(self.process_id)  # every log line of this process says which replica wrote it
        self.held = held_by(fleet, traffic, recorder)
        self.leads = not self.shared
        """Whether this process checks the servers' health for the gateway (one process does)."""
        self._confirmed = -math.inf
        """When this process last began a heartbeat (or its registration) that went through: the store's
        record of it is no older, so this process stops serving before any other takes it for dead."""
        self._failed = -math.inf
        """When it last began a heartbeat that failed: calls admitted until the next one goes through could
        not be stored, so it serves none."""
        self._metrics_at = 0.0
        self._share_samples = settings.workers > 1
        """Whether its heartbeats carry its metrics, for its port's other workers to add up."""
        self.facts = RunFacts(lambda: self.leads, store, fleet, traffic, recorder)
        metrics.registry.register(self.facts)
        self._beating = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_beats = threading.Event()
        self._beats: threading.Thread | None = None

    @property
    def process_id(self) -> str:
        return str(self.process["process_id"])

    async def start(self) -> None:
        """Register, take the run state (the stored one, unless no other process is alive), and follow it."""
        self._traffic.confirmed = self.confirmed
        if not self.shared:
            return
        began = time.monotonic()
        state = await self._run(
            stored_processes.register, self.process, self.held, self._report(), self.timeout
        )
        self.adopt_if_newer(state)
        self._confirmed = began
        log.info(
            "process %s joined the gateway at run state epoch %d (policy version %s%s)",
            self.process_id,
            state.epoch,
            state.policy_version,
            ", paused" if state.paused else "",
        )
        self.run_in_background(self._follow())
        loop = asyncio.get_running_loop()
        self._beats = threading.Thread(target=self._beat_aside, args=(loop,), name="heartbeat", daemon=True)
        self._beats.start()

    async def close(self) -> None:
        self._stop_beats.set()
        if self._beats is not None:
            await asyncio.to_thread(self._beats.join)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.shared:
            try:
                await self._run(stored_processes.leave, self.process_id)
            except Exception as exc:  # a process leaving a lost store is already counted dead
                log.warning("process %s could not deregister: %r", self.process_id, exc)

    # -- changes ------------------------------------------------------------------------------------------

    async def change(self, edit: Callable[[RunState], None], *, wait: bool = True) -> RunState:
        """Make the next run state (`edit` applied to the current one) and, with `wait`, return once every
        live process holds it. `edit` raises to refuse the change (KeyError, ValueError), which then changes
        nothing; an edit that changes nothing makes no new run state."""
        if not self.shared:
            state = self.held.model_copy(deep=True)
            edit(state)
            if state != self.held:
                state.epoch = self.held.epoch + 1
                self.adopt_if_newer(state)
            return self.held
        state = await self._run(stored.change, edit, self.process_id)
        self.adopt_if_newer(state)
        if wait:
            await self._beat()
            await self._acknowledged(state.epoch)
        return state

    async def _acknowledged(self, epoch: int) -> None:
        def holds(rows: list[ProcessRow]) -> bool:
            return all(row.applied_epoch >= epoch for row in rows)

        if not await self.until(holds, self.timeout):
            late = [row.process_id for row in await self.alive() if row.applied_epoch < epoch]
            log.warning(
                "run state epoch %d: processes %s did not apply it in %.0f s", epoch, late, self.timeout
            )

    # -- the processes ------------------------------------------------------------------------------------

    async def processes(self) -> list[ProcessRow]:
        """Every registered process, this one first with its numbers as they are now."""
        mine = ProcessRow(**self._report().model_dump(), **self.process, started_at=0.0, heartbeat_age=0.0)
        if not self.shared:
            return [mine]
        rows = await self._run(stored_processes.processes)
        started = next((row.started_at for row in rows if row.process_id == self.process_id), 0.0)
        others = [row for row in rows if row.process_id != self.process_id]
        return [mine.model_copy(update={"started_at": started}), *others]

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
        """Its metrics in Prometheus text, with those of the other live processes on its host and port (its
        fellow workers): never another host's, which Prometheus scrapes there and adds up itself."""
        await self.facts.refresh()
        if not self._share_samples:
            return generate_latest(self._metrics.registry)
        host, port = self.process["host"], self.process["port"]
        others = [
            row.metrics
            for row in (await self.alive())[1:]
            if row.metrics and (row.host, row.port) == (host, port)
        ]
        return exposition_with(self._metrics.registry, others, once=FACTS)

    def confirmed(self) -> bool:
        """Whether this process has confirmed the run state with the store recently enough to serve."""
        return self.unconfirmed() is None

    def unconfirmed(self) -> str | None:
        """Why this process serves no agent call now (the store out of reach), or None."""
        if not self.shared:
            return None
        if self._failed > self._confirmed:
            return "its last heartbeat failed"
        if time.monotonic() - self._confirmed >= self.timeout / 2:
            return f"no heartbeat went through in {self.timeout / 2:g} s (half of --process-timeout)"
        return None

    # -- following ------------------------------------------------------------------------------------------

    async def _follow(self) -> None:
        import psycopg  # the postgres extra's: a SQLite gateway has nothing to follow

        conninfo = make_url(normalize_url(self._db)).set(drivername="postgresql")
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    conninfo.render_as_string(hide_password=False), autocommit=True, connect_timeout=5
                ) as conn:
                    await conn.execute(f"LISTEN {stored.CHANNEL}")
                    while True:
                        await self._beat()
                        await self._lead(conn)
                        wait = _PAUSED_BEAT if self.held.paused else self.interval
                        async for _ in conn.notifies(timeout=wait, stop_after=1):
                            pass
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever broke the way to the store, try again
                self._failed = time.monotonic()
                if self.leads:
                    log.warning("process %s no longer leads", self.process_id)
                self.leads = False
                log.warning("process %s lost the store (%r): retrying", self.process_id, exc)
                await asyncio.sleep(min(self.interval, 1.0))

    async def _beat(self) -> None:
        async with self._beating:
            began = time.monotonic()
            try:
                epoch, pinned = await self._run(
                    stored_processes.beat, self.process_id, self._report(metrics=True)
                )
            except LookupError:  # its row was taken for dead and deleted: it joins again
                state = await self._run(
                    stored_processes.register, self.process, self.held, self._report(), self.timeout
                )
                self.adopt_if_newer(state)
                epoch, pinned = state.epoch, {}
            if epoch > self.held.epoch:
                self.adopt_if_newer(await self._run(stored.read_run_state))
                await self._run(stored_processes.beat, self.process_id, self._report())
            for server in self._fleet.servers.values():
                server.pinned = pinned.get(server.url, 0)
            self._confirmed = max(self._confirmed, began)
        await self.facts.refresh(REFRESH)  # the leader's heartbeats carry them to its port's other workers

    def _beat_aside(self, loop: asyncio.AbstractEventLoop) -> None:
        """Heartbeats from this thread, once an interval, whatever the event loop's lag: under load the loop
        runs its own late (seconds late with a thousand streams a core), and a process is confirmed by the
        store's answer, not by how soon its loop asked. What the loop must apply (a newer run state, the row
        lost and to be registered again) is left to the loop's own heartbeat."""
        while not self._stop_beats.wait(self.interval):
            began = time.monotonic()
            try:
                with self._store.engine.begin() as conn:
                    epoch, _ = stored_processes.beat(conn, self.process_id, self._report())
            except LookupError:  # taken for dead: the loop registers it again
                epoch = self.held.epoch + 1
            except Exception:  # the store is out of reach: the loop's heartbeat says so, and retries
                self._failed = max(self._failed, began)
                continue
            else:
                self._confirmed = max(self._confirmed, began)
            if epoch > self.held.epoch:
                loop.call_soon_threadsafe(self.run_in_background, self._beat())

    async def _lead(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if self.leads:
            return
        cursor = await conn.execute(
            "SELECT pg_try_advisory_lock(%s, hashtext(current_schema()))", (_LEAD_LOCK,)
        )
        row = await cursor.fetchone()
        if row is not None and row[0]:
            self.leads = True
            log.info("process %s leads: it checks the servers' health for the gateway", self.process_id)

    def adopt_if_newer(self, state: RunState | None) -> None:
        """Hold `state` unless this process already holds a newer one."""
        if state is None or state.epoch <= self.held.epoch:
            return
        self.held = state
        adopt(state, self._fleet, self._traffic, self._recorder)

    def _report(self, *, metrics: bool = False) -> ProcessReport:
        send_metrics = (
            self._share_samples and metrics and time.monotonic() - self._metrics_at >= self.interval
        )
        if send_metrics:
            self._metrics_at = time.monotonic()
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
            metrics=samples(self._metrics.registry) if send_metrics else None,
        )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` in one transaction, in a thread."""

        def run() -> T:
            with self._store.engine.begin() as conn:
                return fn(conn, *args)

        return await asyncio.to_thread(run)

    def run_in_background(self, work: Any) -> None:
        """Run `work` in the background, held until done (closing cancels it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("replica work in the background failed: %r", task.exception())
