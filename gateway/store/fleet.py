"""The fleet's rows on PostgreSQL: one transaction per change, announced with NOTIFY, and the processes'
heartbeats (`gateway.fleet.sync` runs these in threads).

Times are the database's clock (`clock_timestamp()`), so that hosts whose clocks differ agree on whose
heartbeat is late.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.engine import Connection

from gateway.fleet.records import FleetState, ProcessReport, ProcessRow, ServerEntry
from gateway.store import schema
from gateway.store.pins import running_pins

CHANNEL = "gateway_fleet"
"""Where each change's epoch is announced."""
_REGISTER_LOCK = 0x726C_F1EE
"""Advisory lock held while a process registers: the first of several starting at once sets the fleet. Like
every lock of the fleet's it is taken with the schema's hash as its second key: gateways in other schemas of
the database are other gateways."""
_FORGOTTEN_AFTER = 3600.0
"""Seconds after its last heartbeat a dead process's row is deleted (until then GET /admin/state lists it)."""


def now(conn: Connection) -> float:
    return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())


def read_fleet(conn: Connection, *, for_update: bool = False) -> FleetState | None:
    query = select(schema.fleet).where(schema.fleet.c.fleet_id == 1)
    row = conn.execute(query.with_for_update() if for_update else query).mappings().first()
    if row is None:
        return None
    s = schema.fleet_servers
    servers = conn.execute(select(s).order_by(s.c.added_at, s.c.url))
    return FleetState(
        epoch=row["epoch"],
        policy_version=row["policy_version"],
        paused=row["paused"],
        pause_mode=row["pause_mode"],
        paused_by=row["paused_by"],
        reloads=row["reloads"],
        weight_version=row["weight_version"],
        servers=[ServerEntry.model_validate(dict(server._mapping)) for server in servers],
    )


def epoch(conn: Connection) -> int:
    return int(conn.execute(select(schema.fleet.c.epoch).where(schema.fleet.c.fleet_id == 1)).scalar_one())


def change(conn: Connection, edit: Callable[[FleetState], None], by: str) -> FleetState:
    """The next fleet: `edit` applied to the stored one (its errors leave the store as it was), numbered and
    announced when the transaction commits; the stored one if `edit` changed nothing."""
    current = read_fleet(conn, for_update=True)
    assert current is not None, "the first process to register writes the fleet"
    fleet = current.model_copy(deep=True)
    edit(fleet)
    if fleet == current:  # nothing to announce
        return current
    fleet.epoch = current.epoch + 1
    at = now(conn)
    _write(conn, fleet, current, at)
    if fleet.reloads > current.reloads:
        conn.execute(
            insert(schema.weight_reloads).values(
                reload=fleet.reloads, epoch=fleet.epoch, requested_by=by, at=at
            )
        )
    return fleet


def _write(conn: Connection, fleet: FleetState, current: FleetState | None, at: float) -> None:
    """Store `fleet` over `current` and announce its epoch (delivered when the transaction commits)."""
    values = fleet.model_dump(exclude={"servers"}) | {"changed_at": at}
    if current is None:
        conn.execute(insert(schema.fleet).values(fleet_id=1, **values))
    else:
        conn.execute(update(schema.fleet).where(schema.fleet.c.fleet_id == 1).values(**values))
    s = schema.fleet_servers
    before = {entry.url: entry for entry in current.servers} if current is not None else {}
    wanted = {entry.url: entry for entry in fleet.servers}
    gone = [url for url in before if url not in wanted]
    if gone:
        conn.execute(delete(s).where(s.c.url.in_(gone)))
    for url, entry in wanted.items():
        if url not in before:
            conn.execute(insert(s).values(**entry.model_dump(), added_at=at))
        elif entry != before[url]:
            conn.execute(update(s).where(s.c.url == url).values(**entry.model_dump()))
    conn.execute(text("SELECT pg_notify(:channel, :epoch)"), {"channel": CHANNEL, "epoch": str(fleet.epoch)})


def register(
    conn: Connection, process: dict[str, Any], own: FleetState, report: ProcessReport, timeout: float
) -> FleetState:
    """Enter `process` (process_id, host, pid, port) and answer the fleet it joins: the stored one while
    another process is alive, else `own` (the first process of a gateway sets its fleet from its settings,
    so a paused or stale fleet left by processes that are all gone does not outlive them)."""
    conn.execute(
        text("SELECT pg_advisory_xact_lock(:key, hashtext(current_schema()))"), {"key": _REGISTER_LOCK}
    )
    at = now(conn)
    p = schema.gateway_processes
    conn.execute(delete(p).where(p.c.heartbeat_at < at - _FORGOTTEN_AFTER))
    alive = conn.execute(select(func.count()).where(p.c.heartbeat_at >= at - timeout)).scalar_one()
    stored = read_fleet(conn, for_update=True)
    if stored is None or not alive:
        fleet = own.model_copy(update={"epoch": (stored.epoch if stored is not None else 0) + 1})
        _write(conn, fleet, stored, at)
    else:
        fleet = stored
    values = _report_values(report) | {"applied_epoch": fleet.epoch}
    conn.execute(insert(p).values(**process, started_at=at, heartbeat_at=at, **values))
    return fleet


def beat(conn: Connection, process_id: str, report: ProcessReport) -> tuple[int, dict[str, int]]:
    """Record a heartbeat; the fleet's epoch now, and the running rollouts pinned to each server."""
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
        ProcessRow.model_validate({**row, "heartbeat_age": max(at - row["heartbeat_at"], 0.0)})
        for row in rows
    ]


def leave(conn: Connection, process_id: str) -> None:
    conn.execute(delete(schema.gateway_processes).where(schema.gateway_processes.c.process_id == process_id))
