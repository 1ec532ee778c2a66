"""The gateway's processes on PostgreSQL: each registers, heartbeats with what it reports of itself, and
leaves; one whose heartbeat is late is dead (`gateway.replicas.shared` runs these in threads).

Times are the database's clock, as for the run state (`gateway.store.run_state`).
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.engine import Connection

from gateway.store.pins import running_pins
from gateway.store.run_state import RunState, epoch, now, read_run_state, write
from rollout_store import schema

_REGISTER_LOCK = 0x726C_F1EE
"""Advisory lock held while a process registers: the first of several starting at once sets the run state.
Like every lock of the gateway's processes it is taken with the schema's hash as its second key: gateways
in other schemas of the database are other gateways."""
_FORGOTTEN_AFTER = 3600.0
"""Seconds after its last heartbeat a dead process's row is deleted (until then GET /admin/state lists it)."""


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a gateway process is: its row's key and where it runs, as `gateway_processes` and GET /admin/state
    name it."""

    process_id: str
    host: str
    pid: int
    port: int
    """The port it serves on (its `--workers` share one)."""

    @classmethod
    def of_this_process(cls, port: int) -> ProcessIdentity:
        """This process, under an id no other takes: a restarted container's process has the same host name
        and pid again."""
        host, pid = socket.gethostname(), os.getpid()
        return cls(f"{host}-{pid}-{uuid.uuid4().hex[:6]}", host, pid, port)

    def columns(self) -> dict[str, str | int]:
        """Its columns of `gateway_processes`, which are also its fields of `ProcessRow`."""
        return {"process_id": self.process_id, "host": self.host, "pid": self.pid, "port": self.port}


class ServerLoad(BaseModel):
    """One process's load on one server (rollouts pinned are the store's count, not a process's)."""

    in_flight: int = 0
    requests: int = 0
    errors: int = 0


class ProcessReport(BaseModel):
    """What a process writes with each heartbeat."""

    applied_epoch: int
    """The newest run state it holds."""
    in_flight: int
    waiting: int
    ended: int
    """Agent calls that have ended since it started."""
    loads: dict[str, ServerLoad]
    adapter_holds: dict[str, int] = {}
    """Its calls in flight on each LoRA adapter version (a version is unloaded once no process holds it)."""
    metrics: dict[str, Any] | None = None
    """Its Prometheus samples (`gateway.metrics.samples`); None: unchanged since the last."""


class ProcessRow(ProcessReport):
    """A process as the store lists it."""

    process_id: str
    host: str
    pid: int
    port: int
    started_at: float
    heartbeat_age: float
    """Seconds since its last heartbeat (on the database's clock)."""


def register(
    conn: Connection, process: ProcessIdentity, own: RunState, report: ProcessReport, timeout: float
) -> RunState:
    """Enter `process` and answer the run state it joins: the stored one while another process is alive, else
    `own` (the first process of a gateway sets the run state from its settings, so a paused or stale state
    left by processes that are all gone does not outlive them)."""
    conn.execute(
        text("SELECT pg_advisory_xact_lock(:key, hashtext(current_schema()))"), {"key": _REGISTER_LOCK}
    )
    at = now(conn)
    p = schema.gateway_processes
    conn.execute(delete(p).where(p.c.heartbeat_at < at - _FORGOTTEN_AFTER))
    alive = conn.execute(select(func.count()).where(p.c.heartbeat_at >= at - timeout)).scalar_one()
    stored = read_run_state(conn, for_update=True)
    if stored is None or not alive:
        state = own.model_copy(update={"epoch": (stored.epoch if stored is not None else 0) + 1})
        write(conn, state, stored, at)
    else:
        state = stored
    values = _report_values(report) | {"applied_epoch": state.epoch}
    conn.execute(insert(p).values(**process.columns(), started_at=at, heartbeat_at=at, **values))
    return state


def beat(conn: Connection, process_id: str, report: ProcessReport) -> tuple[int, dict[str, int]]:
    """Record a heartbeat; the run state's epoch now, and the running rollouts pinned to each server."""
    p = schema.gateway_processes
    at = now(conn)
    values = _report_values(report)
    found = conn.execute(update(p).where(p.c.process_id == process_id).values(heartbeat_at=at, **values))
    if not found.rowcount:
        raise LookupError(f"process {process_id} is no longer registered")
    return epoch(conn), running_pins(conn)


def _report_values(report: ProcessReport) -> dict[str, Any]:
    """Its columns; metrics only when sent (they are sent once a heartbeat interval)."""
    return report.model_dump(exclude_none=True)


def processes(conn: Connection) -> list[ProcessRow]:
    p = schema.gateway_processes
    at = now(conn)
    rows = conn.execute(select(p).order_by(p.c.started_at)).mappings()
    return [
        ProcessRow.model_validate(
            {
                **row,
                "adapter_holds": row["adapter_holds"] or {},
                "heartbeat_age": max(at - row["heartbeat_at"], 0.0),
            }
        )
        for row in rows
    ]


def leave(conn: Connection, process_id: str) -> None:
    conn.execute(delete(schema.gateway_processes).where(schema.gateway_processes.c.process_id == process_id))
