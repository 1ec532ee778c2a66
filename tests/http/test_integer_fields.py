"""An integer field sent as an integral float (`5.0`, which vLLM accepts) is the agent's number, in every
dialect: it reaches the engine as an int, so a trainer's cap and a context limit compare it rather than
replace it. A fraction stays a 422, and `true` is refused rather than read as 1."""

from __future__ import annotations

from typing import Any

import pytest

from support import assert_openai_error
from support.fake_engine import chat_reply, json_reply

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "hi"}]
COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "tiny",
    "choices": [
        {"index": 0, "text": "ok", "finish_reason": "stop", "token_ids": [5], "prompt_token_ids": [1]}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}
DIALECTS: dict[str, tuple[str, dict[str, Any], str]] = {
    # route, the body but its length field, that field
    "chat": ("chat/completions", {"messages": MESSAGES}, "max_tokens"),
    "chat max_completion_tokens": ("chat/completions", {"messages": MESSAGES}, "max_completion_tokens"),
    "completions": ("completions", {"prompt": [1, 2, 3]}, "max_tokens"),
    "messages": ("messages", {"messages": MESSAGES}, "max_tokens"),
    "responses": ("responses", {"input": "hi"}, "max_output_tokens"),
}


async def sent_length(gw: Any, dialect: str, value: Any) -> Any:
    """The reply length the engine got for one call of `dialect` asking `value`."""
    route, body, field = DIALECTS[dialect]
    if route == "completions":
        gw.engine.answer("/v1/completions", json_reply(COMPLETION))
    else:
        gw.engine.answer("/tokenize", json_reply({"tokens": [1, 2, 3], "count": 3}))
        gw.engine.answer("/v1/chat/completions", chat_reply([1, 2, 3], [5], "ok"))

    answer = await gw.client.post(f"/rollouts/r1/v1/{route}", json={"model": "tiny", **body, field: value})

    assert answer.status_code == 200, answer.text
    (sent,) = [request for path, request in gw.engine.requests if path.startswith("/v1/")]
    return sent["max_completion_tokens" if field == "max_completion_tokens" else "max_tokens"]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_an_integral_float_under_a_trainers_cap_stays_the_agents_number(gw, dialect):
    await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": {"max_tokens": 50}})

    length = await sent_length(gw, dialect, 5.0)

    assert (length, type(length)) == (5, int)


async def test_a_number_in_a_string_under_a_trainers_cap_stays_the_agents_number(gw):
    await gw.client.post("/rollouts", json={"rollout_id": "r1", "sampling": {"max_tokens": 50}})

    length = await sent_length(gw, "chat", "5")

    assert (length, type(length)) == (5, int)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_an_integral_float_under_a_context_limit_stays_the_agents_number(start, dialect):
    gw = await start(max_context_tokens=1000)

    length = await sent_length(gw, dialect, 5.0)

    assert (length, type(length)) == (5, int)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_an_integral_float_past_the_room_left_is_capped_to_it(start, dialect):
    gw = await start(max_context_tokens=1000)

    length = await sent_length(gw, dialect, 2000.0)

    assert (length, type(length)) == (997, int)


async def test_every_integer_field_of_a_chat_call_reaches_the_engine_and_the_turn_as_an_int(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "ok"))
    fields = {"n": 1.0, "seed": 7.0, "top_k": 3.0, "logprobs": True, "top_logprobs": 2.0, "max_tokens": 9.0}

    answer = await gw.chat("r1", **fields)

    assert answer.status_code == 200, answer.text
    sent = gw.engine.requests[0][1]
    ints = {
        name: (sent[name], type(sent[name])) for name in ("n", "seed", "top_k", "top_logprobs", "max_tokens")
    }
    assert ints == {
        "n": (1, int),
        "seed": (7, int),
        "top_k": (3, int),
        "top_logprobs": (2, int),
        "max_tokens": (9, int),
    }
    (turn,) = (await gw.rollout("r1", include_messages="true"))["turns"]
    assert (turn["params"]["seed"], turn["params"]["max_tokens"]) == (7, 9)


async def test_a_messages_top_k_and_seed_reach_the_engine_as_ints(gw):
    gw.engine.answer("/v1/chat/completions", chat_reply([1], [5], "ok"))
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4.0, "top_k": 3.0, "seed": 7.0}

    answer = await gw.client.post("/rollouts/r1/v1/messages", json=body)

    assert answer.status_code == 200, answer.text
    sent = gw.engine.requests[0][1]
    assert {name: (sent[name], type(sent[name])) for name in ("max_tokens", "top_k", "seed")} == {
        "max_tokens": (4, int),
        "top_k": (3, int),
        "seed": (7, int),
    }


@pytest.mark.parametrize("value", [5.5, True], ids=["fraction", "true"])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_fraction_or_a_boolean_is_refused_in_every_dialect(gw, dialect, value):
    route, body, field = DIALECTS[dialect]

    answer = await gw.client.post(f"/rollouts/r1/v1/{route}", json={"model": "tiny", **body, field: value})

    error = assert_openai_error(answer, 422, "invalid_request")
    assert error["param"] == field
    assert gw.engine.requests == []
