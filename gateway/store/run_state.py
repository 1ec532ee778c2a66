"""The gateway's run state on PostgreSQL: what every process of the gateway holds alike (the pause, the policy
version, the weights, the vLLM servers with their health), numbered by its `epoch`. Each change is one
transaction, announced with NOTIFY when it commits (`gateway.replicas.shared` runs these in threads).

Times are the database's clock (`clock_timestamp()`), so that hosts whose clocks differ agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel
from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.engine import Connection

from rollout_store import schema

CHANNEL = "gateway_run_state"
"""Where each change's epoch is announced."""

PauseMode = Literal["wait", "abort", "keep"]


class AdapterVersion(BaseModel, frozen=True):
    """One published version of a LoRA policy (`gateway.fleet.adapters`)."""

    policy: str
    version: str
    path: str
    """Where every server reads it: a directory in PEFT's format, never written again."""
    retired: bool = False
    """Past the keep window (--lora-keep): no call goes to it; it is unloaded once no call holds it."""

    @property
    def name(self) -> str:
        """Its name on the servers (vLLM's `lora_name`): the model its calls ask vLLM for. It holds a digest
        of the path, as vLLM's cache keys do: a server that holds the name (loaded by an earlier run of the
        gateway) holds these very weights."""
        digest = hashlib.blake2b(self.path.encode(), digest_size=4).hexdigest()
        return f"{self.policy}@{self.version}-{digest}"


class ServerEntry(BaseModel):
    """A vLLM server of the fleet as the run state holds it."""

    url: str
    draining: bool = False
    healthy: bool = False
    """As the leading process's health checks found it (or a process that could not connect to it); a
    server added at run time is not, until a check has passed."""
    models: list[str] = []
    prefix_cache_hit_rate: float | None = None
    weight_spans: bool | None = None
    """Whether its replies carry each token's weight version (the project's vLLM plugin); None until a health
    check asked."""
    reloads: int = 0
    """The weight reloads this server has done."""
    weight_version: str | None = None
    """The weight version it was given (None: never)."""
    adapter_errors: dict[str, str] = {}
    """Adapter versions it failed to load, with the reason: it serves no call of their policy until a retry
    loads them (its models list the versions it holds)."""


class RunState(BaseModel):
    """A process holds the newest run state it has seen. Loads are not part of it: each process has its own
    and they add up."""

    epoch: int = 0
    policy_version: str
    paused: bool = False
    pause_mode: PauseMode | None = None
    paused_by: str | None = None
    """The process whose admin call paused the gateway."""
    cache_kept: bool = False
    """Whether the last pause kept the servers' caches: turns that span the update it made room for went on
    with keys and values of the previous weights."""
    reloads: int = 0
    """Weight reloads the servers have done (`/admin/reload_weights`)."""
    weight_version: str | None = None
    adapters: list[AdapterVersion] = []
    """The LoRA policies' versions the servers hold, oldest first (`gateway.fleet.adapters`)."""
    servers: list[ServerEntry]

    def server(self, url: str) -> ServerEntry | None:
        return next((entry for entry in self.servers if entry.url == url), None)


def now(conn: Connection) -> float:
    return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())


def read_run_state(conn: Connection, *, for_update: bool = False) -> RunState | None:
    query = select(schema.run_state).where(schema.run_state.c.run_state_id == 1)
    row = conn.execute(query.with_for_update() if for_update else query).mappings().first()
    if row is None:
        return None
    s = schema.fleet_servers
    servers = conn.execute(select(s).order_by(s.c.added_at, s.c.url))
    return RunState(
        epoch=row["epoch"],
        policy_version=row["policy_version"],
        paused=row["paused"],
        pause_mode=row["pause_mode"],
        paused_by=row["paused_by"],
        cache_kept=row["cache_kept"],
        reloads=row["reloads"],
        weight_version=row["weight_version"],
        adapters=row["adapters"] or [],
        servers=[_entry(dict(server._mapping)) for server in servers],
    )


def _entry(row: dict[str, object]) -> ServerEntry:
    return ServerEntry.model_validate(row | {"adapter_errors": row["adapter_errors"] or {}})


def epoch(conn: Connection) -> int:
    r = schema.run_state
    return int(conn.execute(select(r.c.epoch).where(r.c.run_state_id == 1)).scalar_one())


def change(conn: Connection, edit: Callable[[RunState], None], by: str) -> RunState:
    """The next run state: `edit` applied to the stored one (its errors leave the store as it was), numbered
    and announced when the transaction commits; the stored one if `edit` changed nothing."""
    current = read_run_state(conn, for_update=True)
    assert current is not None, "the first process to register writes the run state"
    state = current.model_copy(deep=True)
    edit(state)
    if state == current:  # nothing to announce
        return current
    state.epoch = current.epoch + 1
    at = now(conn)
    write(conn, state, current, at)
    if state.reloads > current.reloads:
        conn.execute(
            insert(schema.weight_reloads).values(
                reload=state.reloads, epoch=state.epoch, requested_by=by, at=at
            )
        )
    return state


def write(conn: Connection, state: RunState, current: RunState | None, at: float) -> None:
    """Store `state` over `current` and announce its epoch (delivered when the transaction commits)."""
    values = state.model_dump(exclude={"servers"}) | {"changed_at": at}
    r = schema.run_state
    if current is None:
        conn.execute(insert(r).values(run_state_id=1, **values))
    else:
        conn.execute(update(r).where(r.c.run_state_id == 1).values(**values))
    s = schema.fleet_servers
    before = {entry.url: entry for entry in current.servers} if current is not None else {}
    wanted = {entry.url: entry for entry in state.servers}
    gone = [url for url in before if url not in wanted]
    if gone:
        conn.execute(delete(s).where(s.c.url.in_(gone)))
    for url, entry in wanted.items():
        if url not in before:
            conn.execute(insert(s).values(**entry.model_dump(), added_at=at))
        elif entry != before[url]:
            conn.execute(update(s).where(s.c.url == url).values(**entry.model_dump()))
    conn.execute(text("SELECT pg_notify(:channel, :epoch)"), {"channel": CHANNEL, "epoch": str(state.epoch)})
