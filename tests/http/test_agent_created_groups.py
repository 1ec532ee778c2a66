"""A rollout an agent's first call creates is created as `POST /rollouts` with its id alone would create it:
in the group its id names. A first call on the id of a group of other rollouts joins it while `POST /rollouts`
would let it, and is refused with the same 409 (OpenAI format, before any engine time, nothing stored) where
it would not: a group past its size, or one a trainer took, is never changed by an agent's call.

The gateway here runs its own fleet (one server, a raw socket answering as vLLM does), whose first pin of a
rollout creates it; with the scripted engine, whose pins live in memory, the first turn creates it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from rollout_store.database import make_engine
from trainer_client import TrainerClient

from support import assert_openai_error
from support.fake_engine import chat_completion, chat_reply
from support.raw_http import Serve

pytestmark = pytest.mark.anyio

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
TOKENIZE = {"model": "tiny", "prompt": "hi"}
ANSWERS = {
    "/v1/chat/completions": chat_completion([1, 2, 3], [7, 8], "ok"),
    "/tokenize": {"count": 3, "max_model_len": 64, "tokens": [1, 2, 3]},
}


@dataclass
class OwnFleet:
    """A gateway with its own fleet of one server, and the calls that server was sent (its health checks
    aside)."""

    client: httpx.AsyncClient
    db: str
    calls: list[str] = field(default_factory=list)

    async def agent_calls(self, rollout_id: str) -> dict[str, httpx.Response]:
        """A first call of each kind on the rollout's base URL: chat, streamed chat and /tokenize."""
        base = f"/rollouts/{rollout_id}"
        return {
            "chat": await self.client.post(f"{base}/v1/chat/completions", json=CHAT),
            "stream": await self.client.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": True}),
            "tokenize": await self.client.post(f"{base}/tokenize", json=TOKENIZE),
        }

    def groups(self) -> dict[str, tuple[int | None, int]]:
        """Each group's declared size and members, as the documented `group_stats` view counts them."""
        engine = make_engine(self.db)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text("SELECT group_id, group_size, rollouts FROM group_stats"))
                return {group: (size, members) for group, size, members in rows}
        finally:
            engine.dispose()


@pytest.fixture
async def own_fleet(serve: Serve, start: Callable[..., Awaitable[Any]]) -> OwnFleet:
    calls: list[str] = []

    async def vllm(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: asyncio.Server) -> None:
        """Answers each request on the connection: chat completions and /tokenize as vLLM does, else {}."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].decode().split(" ")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in lines
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if method == "POST":  # not the fleet's health checks
                    calls.append(path)
                body = orjson.dumps(ANSWERS.get(path, {}))
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            writer.close()

    gateway = await start(backend=[await serve(vllm)], scripted=False)
    calls.clear()  # the start's probes
    return OwnFleet(gateway.client, gateway.db, calls)


async def create(client: httpx.AsyncClient, rollout_id: str, **fields: object) -> None:
    answer = await client.post("/rollouts", json={"rollout_id": rollout_id, **fields})
    assert answer.status_code == 201, answer.text


async def finish(client: httpx.AsyncClient, rollout_id: str) -> None:
    answer = await client.post(f"/rollouts/{rollout_id}/finish", json={"reward": 1.0})
    assert answer.status_code == 200, answer.text


async def test_first_calls_on_the_id_of_a_full_group_are_409_group_full_before_the_engine(own_fleet):
    for member in ("a", "b"):
        await create(own_fleet.client, member, group_id="g", group_size=2)
        await finish(own_fleet.client, member)

    answers = await own_fleet.agent_calls("g")

    for answer in answers.values():
        error = assert_openai_error(answer, 409, "group_full")
        assert error["message"] == "group 'g' has its 2 members already"
    assert own_fleet.calls == []
    assert (await own_fleet.client.get("/rollouts/g")).status_code == 404
    assert own_fleet.groups() == {"g": (2, 2)}


async def test_first_calls_on_the_id_of_a_group_a_trainer_took_are_409_group_claimed(own_fleet):
    await create(own_fleet.client, "a", group_id="g")
    assert (await own_fleet.client.post("/rollouts/a/v1/chat/completions", json=CHAT)).status_code == 200
    await finish(own_fleet.client, "a")
    with TrainerClient(own_fleet.db) as trainer:
        assert [sample.rollout_id for sample in trainer.claim("trainer-0", 0).samples] == ["a"]
    own_fleet.calls.clear()

    answers = await own_fleet.agent_calls("g")

    for answer in answers.values():
        error = assert_openai_error(answer, 409, "group_claimed")
        assert (
            error["message"]
            == "group 'g' was taken by a trainer already: a new member would not train with it"
        )
    assert own_fleet.calls == []
    assert (await own_fleet.client.get("/rollouts/g")).status_code == 404
    assert own_fleet.groups() == {"g": (None, 1)}


async def test_a_first_call_on_the_id_of_a_group_with_room_joins_it_as_a_member_of_its_size(own_fleet):
    await create(own_fleet.client, "a", group_id="g", group_size=2)

    answer = await own_fleet.client.post("/rollouts/g/tokenize", json=TOKENIZE)

    assert answer.json()["tokens"] == [1, 2, 3]
    joined = (await own_fleet.client.get("/rollouts/g")).json()
    assert (joined["group_id"], joined["group_size"], joined["status"]) == ("g", 2, "running")
    assert own_fleet.groups() == {"g": (2, 2)}


async def test_a_first_turn_on_the_id_of_a_full_group_is_409_group_full_and_stores_nothing(gw):
    """The scripted engine's pins live in memory: the rollout is created by its first turn's commit."""
    for member in ("a", "b"):
        await gw.client.post("/rollouts", json={"rollout_id": member, "group_id": "g", "group_size": 2})
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [7, 8], "ok"))

    answer = await gw.chat("g")

    assert_openai_error(answer, 409, "group_full")
    assert (await gw.client.get("/rollouts/g")).status_code == 404
