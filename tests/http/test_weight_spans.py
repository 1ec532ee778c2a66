"""Each completion token's weight version, from a server with the project's vLLM plugin: the turn keeps the
spans the plugin adds to a choice, the agent receives vLLM's reply without them, and spans that are not what
the plugin sends are not kept (the turn is, as it would be from a server without the plugin). Health checks
find which servers have the plugin."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
import pytest

from support import until
from support.fake_engine import chat_reply, chat_stream, json_reply

pytestmark = pytest.mark.anyio

SPANNED = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]


async def test_a_whole_reply_keeps_its_spans_and_the_agent_gets_none(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [7, 8, 0], "hey", spans=SPANNED))

    answer = await gw.chat("r1")

    assert answer.status_code == 200
    assert "weight_versions" not in answer.json()["choices"][0]
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert turn["weight_versions"] == SPANNED


async def test_a_stream_keeps_the_spans_of_its_finish_chunk_and_the_agent_gets_none(gw):
    pieces = [(10, "a"), (11, "b"), (0, "")]
    gw.engine.answer("/v1/chat/completions", chat_stream([4, 5], pieces, spans=SPANNED))

    answer = await gw.chat("r1", stream=True)

    assert answer.status_code == 200
    assert b"weight_versions" not in answer.content
    events = [orjson.loads(line[6:]) for line in answer.text.split("\n\n") if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert turn["weight_versions"] == SPANNED


async def test_a_reply_from_a_server_without_the_plugin_keeps_no_spans(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [7, 8, 0], "hey"))

    assert (await gw.chat("r1")).status_code == 200

    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["weight_versions"], turn["policy_version"], turn["policy_version_end"]) == (None, "0", "0")


async def test_every_choice_of_n_keeps_its_own_spans(gw):
    first = [{"version": "3", "start": 0, "end": 2}]
    second = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    reply: dict[str, Any] = orjson.loads(await chat_reply([1, 2], [7, 0], "a", spans=first).body())
    other = {**reply["choices"][0], "index": 1, "token_ids": [9, 9, 0], "weight_versions": second}
    reply["choices"].append(other)
    gw.engine.answer("/v1/chat/completions", json_reply(reply))

    answer = await gw.chat("r1", n=2)

    assert answer.status_code == 200
    assert [sorted(choice) for choice in answer.json()["choices"]] == [
        ["finish_reason", "index", "logprobs", "message", "token_ids"]
    ] * 2
    turns = (await gw.rollout("r1"))["turns"]
    assert [(t["choice_index"], t["weight_versions"]) for t in turns] == [(0, first), (1, second)]


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "3", "start": 0, "end": 2}],  # fewer tokens than the completion's
        [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 2, "end": 3}],  # a gap
        [{"version": "3", "start": 1, "end": 3}],  # not from the first token
        [{"version": "3", "start": 0, "end": 0}, {"version": "4", "start": 0, "end": 3}],  # an empty span
        [{"version": 3, "start": 0, "end": 3}],  # a version that is not text
        [{"version": "3", "start": 0, "end": 3.0}],  # an end that is not an integer
        [{"version": "3", "start": 0, "end": True}],
        [{"version": "3", "start": 0, "end": 3, "extra": 1}],
        [["3", 0, 3]],
        {"version": "3", "start": 0, "end": 3},
        "3",
    ],
)
async def test_spans_that_are_not_the_plugins_are_not_kept_and_the_turn_is(gw, spans):
    gw.engine.answer("/v1/chat/completions", chat_reply([1, 2], [7, 8, 0], "hey", spans=spans))

    answer = await gw.chat("r1")

    assert answer.status_code == 200
    assert "weight_versions" not in answer.json()["choices"][0]
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["status"], turn["completion_token_ids"], turn["weight_versions"]) == ("ok", [7, 8, 0], None)


async def test_a_completions_reply_keeps_its_spans_and_the_agent_gets_none(gw):
    choice = {
        "index": 0,
        "text": "<4><5>",
        "finish_reason": "length",
        "logprobs": {"token_logprobs": [-0.5, -0.5], "tokens": ["t4", "t5"]},
        "token_ids": [4, 5],
        "prompt_token_ids": [1, 2, 3],
        "weight_versions": [{"version": "0", "start": 0, "end": 2}],
    }
    reply = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [choice],
    }
    gw.engine.answer("/v1/completions", json_reply(reply))

    answer = await gw.client.post("/rollouts/r1/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3]})

    assert answer.status_code == 200
    assert "weight_versions" not in answer.json()["choices"][0]
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert turn["weight_versions"] == [{"version": "0", "start": 0, "end": 2}]


DIALECTS = {
    "messages": {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
    "responses": {"model": "tiny", "input": "Hi"},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_an_agent_of_another_dialect_gets_no_spans_and_its_turn_keeps_them(gw, dialect, stream):
    spans = [{"version": "1", "start": 0, "end": 2}]
    reply = (
        chat_stream([1, 2], [(5, "Hi"), (2, "")], spans=spans)
        if stream
        else chat_reply([1, 2], [5, 2], "Hi", spans=spans)
    )
    gw.engine.answer("/v1/chat/completions", reply)

    answer = await gw.client.post(f"/rollouts/r1/v1/{dialect}", json={**DIALECTS[dialect], "stream": stream})

    assert answer.status_code == 200
    assert b"weight_versions" not in answer.content
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert turn["weight_versions"] == spans


def vllm_routes(plugin: tuple[int, bytes]) -> Any:
    """A raw server answering the routes a health check asks, `/rl-gateway/plugin` with `plugin`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _server: Any) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *([0-9]+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                path = head.split(b" ")[1]
                status, body = {
                    b"/health": (200, b""),
                    b"/v1/models": (200, orjson.dumps({"data": [{"id": "tiny"}]})),
                    b"/metrics": (200, b""),
                    b"/rl-gateway/plugin": plugin,
                }.get(path, (404, b"{}"))
                head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                writer.write(head % (status, len(body)) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            writer.close()

    return handle


PLUGIN = {"plugin": "rl-gateway-vllm", "version": "0.1.0", "fields": ["weight_versions"]}


@pytest.mark.parametrize(
    ("plugin", "spans", "gauge"),
    [
        ((200, orjson.dumps(PLUGIN)), True, "1.0"),
        ((404, b'{"detail":"Not Found"}'), False, "0.0"),
        ((500, b"{}"), False, "0.0"),
        ((200, orjson.dumps({**PLUGIN, "fields": []})), False, "0.0"),
        ((200, orjson.dumps(["weight_versions"])), False, "0.0"),
        ((200, b"not json"), None, None),  # not an answer: unknown, and the server is healthy all the same
    ],
)
async def test_the_health_check_finds_which_servers_report_spans(start, serve, plugin, spans, gauge):
    url = await serve(vllm_routes(plugin))
    gw = await start(backend=[url], scripted=False)
    fleet = gw.app.state.admin.fleet
    await until(lambda: fleet.servers[url].models, "the first health check")

    (backend,) = (await gw.client.get("/admin/state")).json()["backends"]
    metrics = (await gw.client.get("/metrics")).text.splitlines()

    assert (backend["healthy"], backend["weight_spans"]) == (True, spans)
    sample = f'gateway_backend_weight_spans{{backend="{url}"}}'
    assert [line.rpartition(" ")[2] for line in metrics if line.startswith(sample)] == (
        [gauge] if gauge else []
    )
