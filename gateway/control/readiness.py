"""What makes a gateway process ready to serve (`GET /readyz`): the store reachable as the agent path reaches
it, a schema no older than this gateway's, and the backends' health, which is shown but never counts."""

from __future__ import annotations

import asyncio
from functools import cache

from alembic.script import ScriptDirectory

from gateway.control.context import ControlContext
from gateway.control.protocol import BackendsHealth, ModelHealth, ServerHealth
from gateway.fleet.servers import Server
from rollout_store.database import alembic_config, current_revision, driver_cause


async def store_reasons(control: ControlContext) -> list[str]:
    """The store as the agent path sees it: on PostgreSQL, the heartbeats that keep agent calls admitted
    (without them calls are refused, 503 `store_unavailable`); then, on either store, a read through the
    engine the calls use, which also tells the schema's revision."""
    unconfirmed = control.replica.unconfirmed()
    if unconfirmed is not None:
        return [f"store unreachable: {unconfirmed}: agent calls are refused"]
    try:
        revision = await asyncio.to_thread(current_revision, control.store.engine)
    except Exception as exc:  # whatever the driver raises, the store did not answer
        return [f"store unreachable: {driver_cause(exc)}"]
    return schema_reasons(revision)


def schema_reasons(revision: str | None) -> list[str]:
    """An empty or older schema is a reason; a newer one is not (a rolling upgrade migrates first, and the
    processes of the previous release keep serving on it)."""
    head, known = revisions()
    if revision == head or (revision is not None and revision not in known):
        return []
    found = "empty" if revision is None else f"at revision {revision}"
    return [f"schema older than this gateway needs: the database is {found}, it needs {head}"]


@cache
def revisions() -> tuple[str, frozenset[str]]:
    """This gateway's head revision, and every revision its migrations know (read once: they ship with it)."""
    scripts = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return scripts.get_current_head() or "", frozenset(script.revision for script in scripts.walk_revisions())


def backends_health(servers: list[Server]) -> BackendsHealth:
    models: dict[str, ModelHealth] = {}
    for server in servers:
        for model in sorted(server.models):
            counts = models.setdefault(model, ModelHealth(healthy=0, total=0))
            counts.total += 1
            counts.healthy += server.healthy
    return BackendsHealth(
        healthy=sum(server.healthy for server in servers),
        total=len(servers),
        models=models,
        servers={
            server.url: ServerHealth(
                healthy=server.healthy,
                draining=server.draining,
                models=sorted(server.models),
                adapter_errors=dict(server.adapter_errors),
            )
            for server in servers
        },
    )
