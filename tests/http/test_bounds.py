"""Every field of an agent's request that the gateway itself packs, counts or caps is bounded where the
request is checked: out of range is a 422 naming the field, never a 500, and nothing reaches the engine or
the store. Token ids fit the store's 32 bits (0..2**31-1), `n` is 1..128, reply lengths at most 2**31-1."""

from __future__ import annotations

from typing import Any

import pytest

from support import assert_openai_error
from support.fake_engine import chat_reply, json_reply

pytestmark = pytest.mark.anyio

TOP_ID = 2**31 - 1
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(prompt_ids: list[int], token_ids: list[int]) -> dict[str, Any]:
    """A whole completion as vLLM answers one with `return_token_ids` and `logprobs`."""
    choice = {
        "index": 0,
        "text": "ok",
        "finish_reason": "stop",
        "logprobs": {"token_logprobs": [-0.5] * len(token_ids), "tokens": ["t"] * len(token_ids)},
        "token_ids": token_ids,
        "prompt_token_ids": prompt_ids,
    }
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids)}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [choice],
    } | {"usage": usage}


async def refused(gw: Any, path: str, body: dict[str, Any], param: str) -> None:
    answer = await gw.client.post(f"/rollouts/r1/v1/{path}", json=body)

    error = assert_openai_error(answer, 422, "invalid_request")
    assert error["param"] == param
    assert gw.engine.requests == []
    assert (await gw.client.get("/rollouts/r1")).status_code == 404


async def test_a_prompt_id_past_2_63_under_a_context_limit_is_a_422_not_a_500(start):
    gw = await start(max_context_tokens=300)

    await refused(
        gw, "completions", {"model": "tiny", "prompt": [14326881642492719104], "max_tokens": 4}, "prompt"
    )


@pytest.mark.parametrize(
    "prompt",
    [[2**31], [-1], [1, 2**63], ["5"], [1.0], [True], [2.0**64]],
    ids=["2**31", "negative", "2**63", "string", "float", "bool", "past-2**64"],
)
async def test_completions_prompt_ids_outside_the_stored_range_are_refused(start, prompt):
    gw = await start(max_context_tokens=300)

    await refused(gw, "completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4}, "prompt")


@pytest.mark.parametrize("route", ["completions", "chat/completions/tokens"])
async def test_the_largest_stored_id_is_accepted_and_recorded_as_sent(start, route):
    gw = await start(max_context_tokens=300)
    if route == "completions":
        gw.engine.answer("/v1/completions", json_reply(completion([TOP_ID, 0], [5])))
        body: dict[str, Any] = {"model": "tiny", "prompt": [TOP_ID, 0], "max_tokens": 4}
    else:
        gw.engine.answer("/v1/chat/completions", chat_reply([TOP_ID, 0], [5], "ok"))
        body = {"model": "tiny", "messages": MESSAGES, "tokens": [TOP_ID, 0], "max_tokens": 4}

    answer = await gw.client.post(f"/rollouts/r1/v1/{route}", json=body)

    assert answer.status_code == 200, answer.text
    sent = gw.engine.requests[0][1]
    ids = sent["prompt"] if route == "completions" else sent["kv_transfer_params"]["prompt_token_ids"]
    assert (ids, sent["max_tokens"]) == ([TOP_ID, 0], 4)
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["prompt_token_ids"], turn["completion_token_ids"]) == ([TOP_ID, 0], [5])


@pytest.mark.parametrize(
    ("tokens", "param"),
    [([2**31], "tokens.0"), ([0, -1], "tokens.1"), ([1.0], "tokens.0"), ([True], "tokens.0")],
    ids=["2**31", "negative", "float", "bool"],
)
async def test_the_tokens_routes_ids_outside_the_stored_range_are_refused(gw, tokens, param):
    await refused(
        gw, "chat/completions/tokens", {"model": "tiny", "messages": MESSAGES, "tokens": tokens}, param
    )


ROUTES = {
    "chat": ("chat/completions", {"messages": MESSAGES}),
    "tokens": ("chat/completions/tokens", {"messages": MESSAGES, "tokens": [1]}),
    "completions": ("completions", {"prompt": "hi"}),
}
OUT_OF_RANGE = [("n", 0), ("n", -1), ("n", 129), ("max_tokens", 2**31), ("max_tokens", 2**63)]


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [(route, field, value) for route in ROUTES for field, value in OUT_OF_RANGE]
    + [("chat", "max_completion_tokens", 2**31), ("tokens", "max_completion_tokens", 2**31)],
)
async def test_counted_fields_out_of_range_are_refused(gw, route, field, value):
    path, body = ROUTES[route]

    await refused(gw, path, {"model": "tiny", **body, field: value}, field)


@pytest.mark.parametrize(
    ("field", "value"), [("n", 128), ("max_tokens", TOP_ID), ("max_completion_tokens", TOP_ID)]
)
async def test_counted_fields_at_their_edge_go_to_the_engine_as_sent(gw, field, value):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "ok"))

    answer = await gw.chat("r1", **{field: value})

    assert answer.status_code == 200, answer.text
    assert gw.engine.requests[0][1][field] == value


async def test_a_reply_length_under_the_context_limit_is_capped_to_the_room_left(start):
    gw = await start(max_context_tokens=300)
    gw.engine.answer("/v1/completions", json_reply(completion([1, 2], [5])))

    answer = await gw.client.post(
        "/rollouts/r1/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": TOP_ID}
    )

    assert answer.status_code == 200, answer.text
    assert gw.engine.requests[0][1]["max_tokens"] == 298


@pytest.mark.parametrize("value", [0, 2**31])
async def test_a_messages_max_tokens_out_of_range_is_refused(gw, value):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": value}

    await refused(gw, "messages", body, "max_tokens")


async def test_a_messages_max_tokens_at_its_edge_is_sent_on(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "ok"))

    answer = await gw.client.post(
        "/rollouts/r1/v1/messages", json={"model": "tiny", "messages": MESSAGES, "max_tokens": TOP_ID}
    )

    assert answer.status_code == 200, answer.text
    assert gw.engine.requests[0][1]["max_tokens"] == TOP_ID


@pytest.mark.parametrize("value", [0, 2**31])
async def test_a_responses_max_output_tokens_out_of_range_is_refused(gw, value):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": value}

    await refused(gw, "responses", body, "max_output_tokens")


async def test_a_responses_max_output_tokens_at_its_edge_is_sent_on(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "ok"))

    answer = await gw.client.post(
        "/rollouts/r1/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": TOP_ID}
    )

    assert answer.status_code == 200, answer.text
    assert gw.engine.requests[0][1]["max_tokens"] == TOP_ID


async def test_engine_ids_that_do_not_fit_are_not_stored_wrapped(gw):
    reply = chat_reply([1, 2**31], [5, -1], "ok")
    gw.engine.answer("/v1/chat/completions", reply)

    answer = await gw.chat("r1")

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "ok"
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["status"], turn["prompt_token_ids"], turn["completion_token_ids"], turn["content"]) == (
        "ok",
        [],
        [],
        "ok",
    )


async def test_a_call_refused_by_the_context_limit_stores_its_prompt_ids_at_the_edge(start):
    gw = await start(max_context_tokens=2)
    await gw.client.post("/rollouts", json={"rollout_id": "r1"})

    answer = await gw.client.post(
        "/rollouts/r1/v1/completions", json={"model": "tiny", "prompt": [TOP_ID, 0], "max_tokens": 4}
    )

    assert_openai_error(answer, 400, "context_length_exceeded")
    assert gw.engine.requests == []
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["status"], turn["prompt_token_ids"], turn["completion_token_ids"]) == (
        "refused",
        [TOP_ID, 0],
        [],
    )
