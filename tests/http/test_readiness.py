"""The probes: /healthz says the process serves (liveness), /readyz whether it can serve calls (readiness),
and why not; the backends' health is shown by /readyz but never makes a process unready."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from gateway import __version__
from rollout_store.database import alembic_config, ensure_schema, head_revision, make_engine
from testbed.process import refusing_port

import support
from support.fake_engine import URL, HeldReply, chat_stream

pytestmark = pytest.mark.anyio

HEALTHY = {
    "healthy": 1,
    "total": 1,
    "models": {},
    "servers": {URL: {"healthy": True, "draining": False, "models": [], "adapter_errors": {}}},
}


def readiness(reasons: list[str], backends: dict[str, Any] = HEALTHY) -> dict[str, Any]:
    return {
        "ready": not reasons,
        "reasons": reasons,
        "backends": backends,
        "policy_version": "0",
        "version": __version__,
    }


async def test_a_gateway_that_can_serve_is_ready(gw):
    answer = await gw.client.get("/readyz")

    assert (answer.status_code, answer.json()) == (200, readiness([]))


async def test_an_ejected_backend_shows_in_readyz_but_leaves_the_gateway_ready_and_live(gw):
    server = gw.engine.servers[URL]
    server.models, server.healthy = frozenset({"tiny"}), False

    ready, live = await gw.client.get("/readyz"), await gw.client.get("/healthz")

    ejected = {
        "healthy": 0,
        "total": 1,
        "models": {"tiny": {"healthy": 0, "total": 1}},
        "servers": {URL: {"healthy": False, "draining": False, "models": ["tiny"], "adapter_errors": {}}},
    }
    assert (ready.status_code, ready.json()) == (200, readiness([], ejected))
    assert (live.status_code, live.json()) == (
        200,
        {"status": "ok", "version": __version__, "policy_version": "0", "backends": [URL]},
    )


async def test_a_store_lost_makes_the_gateway_unready_as_agent_calls_fail_and_regained_ready_again(gw):
    path = Path(gw.db.removeprefix("sqlite:///"))
    aside = path.with_name("aside.db")
    path.rename(aside)
    path.mkdir()  # where the store's file was, nothing SQLite can open
    gw.app.state.control.store.engine.dispose()  # its connections opened the file before it went

    lost = await gw.client.get("/readyz")
    unreachable = "store unreachable: unable to open database file"
    call = await gw.chat("r1")
    live = await gw.client.get("/healthz")

    assert (lost.status_code, lost.json()) == (503, readiness([unreachable]))
    assert (call.status_code, call.json()["error"]["code"]) == (503, "store_unavailable")
    assert live.status_code == 200

    path.rmdir()
    aside.rename(path)
    await support.until(
        lambda: ready_status(gw.client, 200), "the gateway ready again once its store is back"
    )
    assert (await gw.client.get("/readyz")).json() == readiness([])


async def test_a_replica_cut_off_from_its_store_is_unready_as_it_refuses_agent_calls_and_ready_once_back(
    databases, start
):
    db = databases.new("postgresql")
    ensure_schema(db)
    gateway = await start(db=db, heartbeat_interval=0.1, process_timeout=2)
    client, store = gateway.client, gateway.app.state.control.store
    cut_off = ["store unreachable: its last heartbeat failed: agent calls are refused"]
    reached = store.engine
    # What the heartbeats go through, now to a port where nothing listens: as a host cut off.
    store.engine = make_engine(f"postgresql://postgres@127.0.0.1:{refusing_port()}/test")
    await support.until(lambda: reasons(client, cut_off), "readyz to say the store is out of reach")
    lost = await client.get("/readyz")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    refused = await client.post("/rollouts/r1/v1/chat/completions", json=body)
    live = await client.get("/healthz")

    store.engine.dispose()
    store.engine = reached
    await support.until(lambda: ready_status(client, 200), "the replica ready again once its store is back")

    assert (lost.status_code, lost.json()) == (503, readiness(cut_off))
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "store_unavailable")
    assert live.status_code == 200


async def reasons(client: httpx.AsyncClient, expected: list[str]) -> bool:
    return (await client.get("/readyz")).json()["reasons"] == expected


async def ready_status(client: httpx.AsyncClient, status: int) -> bool:
    return (await client.get("/readyz")).status_code == status


def set_revision(db: str, revision: str) -> None:
    engine = create_engine(db)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :revision"), {"revision": revision})
    engine.dispose()


async def test_a_schema_older_than_the_gateway_needs_makes_it_unready(gw):
    head = head_revision()
    older = previous_revision(head)
    set_revision(gw.db, older)

    answer = await gw.client.get("/readyz")

    reason = f"schema older than this gateway needs: the database is at revision {older}, it needs {head}"
    assert (answer.status_code, answer.json()) == (503, readiness([reason]))


async def test_a_schema_newer_than_the_gateway_knows_leaves_it_ready(gw):
    set_revision(gw.db, "f0f0f0f0f0f0")  # a later release's migration, run first in a rolling upgrade

    answer = await gw.client.get("/readyz")

    assert (answer.status_code, answer.json()) == (200, readiness([]))


def previous_revision(head: str) -> str:
    script = ScriptDirectory.from_config(alembic_config("sqlite://")).get_revision(head)
    assert script is not None and isinstance(script.down_revision, str)
    return script.down_revision


async def test_probes_are_open_when_the_control_api_needs_a_token(start):
    gw = await start(control_token="control-secret")

    ready, live = await gw.client.get("/readyz"), await gw.client.get("/healthz")
    refused = await gw.client.get("/rollouts/r1")

    assert (ready.status_code, live.status_code, refused.status_code) == (200, 200, 401)


async def test_both_probes_are_in_the_openapi_schema_with_their_answers(gw):
    paths = (await gw.client.get("/openapi.json")).json()["paths"]

    def answers(path: str) -> dict[str, Any]:
        responses = paths[path]["get"]["responses"]
        return {code: r["content"]["application/json"]["schema"] for code, r in responses.items()}

    assert answers("/healthz") == {"200": {"$ref": "#/components/schemas/Health"}}
    assert answers("/readyz") == {
        "200": {"$ref": "#/components/schemas/Readiness"},
        "503": {"$ref": "#/components/schemas/Readiness"},
    }
    assert "security" not in paths["/readyz"]["get"] and "security" not in paths["/healthz"]["get"]


async def test_a_gateway_shutting_down_is_unready_at_once_while_its_streams_finish(gw):
    release = asyncio.Event()
    gw.engine.answer("/v1/chat/completions", HeldReply(chat_stream([4], [(10, "a"), (0, "")]), release))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    call = asyncio.create_task(gw.client.post("/rollouts/r1/v1/chat/completions", json=body))
    traffic = gw.app.state.turns.traffic
    await support.until(lambda: traffic.in_flight == 1, "the stream in flight")

    shutdown = asyncio.create_task(gw.stop())
    await support.until(lambda: ready_status(gw.client, 503), "readyz to say the gateway is shutting down")
    stopping = await gw.client.get("/readyz")
    assert stopping.json() == readiness(["shutting down"])
    assert not shutdown.done()

    release.set()
    streamed = await call
    await shutdown

    assert (streamed.status_code, streamed.text.endswith("data: [DONE]\n\n")) == (200, True)
