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
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.engine import make_url

from gateway.fleet.fleet import Fleet
from gateway.metrics import Metrics, Samples, exposition_with, samples
from gateway.replicas.facts import NAMES as FACTS
from gateway.replicas.facts import REFRESH
from gateway.replicas.replica import Replica
from gateway.store import processes as stored_processes
from gateway.store import run_state as stored
from gateway.store.processes import ProcessIdentity, ProcessRow
from gateway.store.run_state import RunState
from gateway.store.store import Store
from gateway.turns.recording import Recorder
from gateway.turns.traffic import Traffic
from rollout_store.database import normalize_url

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

T = TypeVar("T")
_PAUSED_BEAT = 0.05
"""Seconds between heartbeats while paused."""
_LEAD_LOCK = 0x726C_1EAD
"""Advisory lock the leading process holds on its listening connection (released if it dies), with its
schema's hash as the second key (`gateway.store.processes`)."""


class SharedReplica(Replica):
    """One process of a gateway on PostgreSQL: it registers, follows the stored run state, and leads when it
    holds the lock."""

    def __init__(
        self,
        identity: ProcessIdentity,
        store: Store,
        fleet: Fleet,
        traffic: Traffic,
        recorder: Recorder,
        metrics: Metrics,
        *,
        db: str,
        interval: float,
        timeout: float,
        share_samples: bool,
    ) -> None:
        self.leads = False
        super().__init__(identity, store, fleet, traffic, recorder, metrics, timeout=timeout)
        self._db = db
        """The store's URL, for the connection that LISTENs and holds the leader's lock."""
        self.interval = interval
        """Seconds between heartbeats (`--heartbeat-interval`)."""
        self._confirmed = -math.inf
        """When this process last began a heartbeat (or its registration) that went through: the store's
        record of it is no older, so this process stops serving before any other takes it for dead."""
        self._failed = -math.inf
        """When it last began a heartbeat that failed: calls admitted until the next one goes through could
        not be stored, so it serves none."""
        self._metrics_at = 0.0
        self._share_samples = share_samples
        """Whether its heartbeats carry its metrics, for its port's other workers to add up (`--workers`)."""
        self._beating = asyncio.Lock()
        self._stop_beats = threading.Event()
        self._beats: threading.Thread | None = None

    async def start(self) -> None:
        """Register, take the run state (the stored one, unless no other process is alive), and follow it."""
        self._traffic.confirmed = self.confirmed
        began = time.monotonic()
        state = await self._run(
            stored_processes.register, self.identity, self.held, self._report(), self.timeout
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
        await super().close()
        try:
            await self._run(stored_processes.leave, self.process_id)
        except Exception as exc:  # a process leaving a lost store is already counted dead
            log.warning("process %s could not deregister: %r", self.process_id, exc)

    # -- changes ------------------------------------------------------------------------------------------

    async def change(self, edit: Callable[[RunState], None], *, wait: bool = True) -> RunState:
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
        rows = await self._run(stored_processes.processes)
        started = next((row.started_at for row in rows if row.process_id == self.process_id), 0.0)
        others = [row for row in rows if row.process_id != self.process_id]
        return [self._mine(started), *others]

    async def exposition(self) -> bytes:
        """Its metrics in Prometheus text, with those of the other live processes on its host and port (its
        fellow workers): never another host's, which Prometheus scrapes there and adds up itself."""
        if not self._share_samples:
            return await super().exposition()
        await self.facts.refresh()
        host, port = self.identity.host, self.identity.port
        others = [
            row.metrics
            for row in (await self.alive())[1:]
            if row.metrics and (row.host, row.port) == (host, port)
        ]
        return exposition_with(self._metrics.registry, others, once=FACTS)

    def unconfirmed(self) -> str | None:
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
                report = self._report(self._samples_due())
                epoch, pinned = await self._run(stored_processes.beat, self.process_id, report)
            except LookupError:  # its row was taken for dead and deleted: it joins again
                state = await self._run(
                    stored_processes.register, self.identity, self.held, self._report(), self.timeout
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

    def _samples_due(self) -> Samples | None:
        """Its metrics for this heartbeat's report: once an interval, when its port's other workers add them
        up; None (unchanged) otherwise."""
        if not self._share_samples or time.monotonic() - self._metrics_at < self.interval:
            return None
        self._metrics_at = time.monotonic()
        return samples(self._metrics.registry)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` in one transaction, in a thread."""

        def run() -> T:
            with self._store.engine.begin() as conn:
                return fn(conn, *args)

        return await asyncio.to_thread(run)
