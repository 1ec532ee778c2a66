"""The token routes token-aware clients call under a rollout's base URL: chat from the client's own prompt ids
(recorded as a turn), and vLLM's /tokenize and /detokenize on the rollout's server (recording nothing)."""

from __future__ import annotations

import pytest

from support import assert_openai_error
from support.fake_engine import chat_reply, chat_stream, error_reply, json_reply

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def test_chat_from_the_clients_ids_generates_from_them_and_records_the_turn(gw):
    gw.engine.answer(CHAT, chat_reply([1, 2, 3], [7, 0], "ok"))

    answer = await gw.client.post(
        "/rollouts/r1/v1/chat/completions/tokens",
        json={"model": "tiny", "messages": MESSAGES, "tokens": [1, 2, 3], "max_tokens": 4},
    )

    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "ok"
    (path, sent) = gw.engine.requests[0]
    assert path == CHAT and "tokens" not in sent
    assert sent["kv_transfer_params"] == {"prompt_token_ids": [1, 2, 3]}
    assert (sent["messages"], sent["return_token_ids"], sent["logprobs"]) == (MESSAGES, True, True)
    turn = (await gw.rollout("r1", include_messages="true"))["turns"][0]
    assert (turn["prompt_token_ids"], turn["completion_token_ids"]) == ([1, 2, 3], [7, 0])
    assert (turn["endpoint"], turn["messages"], turn["splice"]) == ("chat", MESSAGES, None)
    assert "tokens" not in turn["params"]


async def test_chat_from_ids_streams_like_chat(gw):
    gw.engine.answer(CHAT, chat_stream([1, 2], [(5, "a"), (0, "")]))

    answer = await gw.client.post(
        "/rollouts/r1/v1/chat/completions/tokens",
        json={"model": "tiny", "messages": MESSAGES, "tokens": [1, 2], "stream": True},
    )

    assert answer.text.endswith("data: [DONE]\n\n")
    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["stream"], turn["prompt_token_ids"], turn["completion_token_ids"]) == (True, [1, 2], [5, 0])


async def test_in_exact_mode_the_clients_ids_are_the_prompt_with_no_render(start):
    gw = await start(mode="exact")
    gw.engine.exact = True
    gw.engine.answer(CHAT, chat_reply([4, 5], [6, 0], "x"))

    await gw.client.post(
        "/rollouts/r1/v1/chat/completions/tokens",
        json={"model": "tiny", "messages": MESSAGES, "tokens": [4, 5]},
    )

    assert [path for path, _ in gw.engine.requests] == [CHAT]
    assert gw.engine.requests[0][1]["kv_transfer_params"] == {"prompt_token_ids": [4, 5]}


async def test_a_reply_from_other_ids_than_the_clients_says_so_in_the_turn(gw):
    gw.engine.answer(CHAT, chat_reply([9, 9], [6, 0], "x"))

    await gw.client.post(
        "/rollouts/r1/v1/chat/completions/tokens",
        json={"model": "tiny", "messages": MESSAGES, "tokens": [4, 5]},
    )

    turn = (await gw.rollout("r1"))["turns"][0]
    assert (turn["prompt_token_ids"], turn["splice"]) == (
        [9, 9],
        "fallback: vLLM rendered the messages itself",
    )


@pytest.mark.parametrize(
    ("tokens", "param"),
    [
        (None, "tokens"),
        ([], "tokens"),
        ([1, -2], "tokens.1"),
        ([2**31], "tokens.0"),
        (["a"], "tokens.0"),
        ("1 2", "tokens"),
    ],
)
async def test_bad_prompt_ids_are_422_and_store_nothing(gw, tokens, param):
    body = {"model": "tiny", "messages": MESSAGES}
    if tokens is not None:
        body["tokens"] = tokens

    answer = await gw.client.post("/rollouts/r1/v1/chat/completions/tokens", json=body)

    error = assert_openai_error(answer, 422, "invalid_request")
    assert error["param"] == param
    assert gw.engine.requests == []


@pytest.mark.parametrize("route", ["tokenize", "detokenize"])
async def test_the_token_routes_answer_what_the_rollouts_server_answers_and_record_nothing(gw, route):
    gw.engine.answer(f"/{route}", json_reply({"tokens": [1, 2], "count": 2, "max_model_len": 2048}))
    body = (
        {"model": "tiny", "messages": MESSAGES}
        if route == "tokenize"
        else {"model": "tiny", "tokens": [1, 2]}
    )

    answer = await gw.client.post(f"/rollouts/r1/{route}", json=body)

    assert answer.json() == {"tokens": [1, 2], "count": 2, "max_model_len": 2048}
    assert gw.engine.requests == [(f"/{route}", body)]
    assert (await gw.client.get("/rollouts/r1")).status_code == 404  # no turn made the rollout


async def test_a_token_route_passes_the_servers_refusal_on_in_openai_form(gw):
    gw.engine.answer("/tokenize", error_reply(400, "The model `other` does not exist.", kind="NotFoundError"))

    answer = await gw.client.post("/rollouts/r1/tokenize", json={"model": "other", "prompt": "hi"})

    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 400,
    }


async def test_a_token_route_refuses_a_body_that_is_not_json(gw):
    answer = await gw.client.post("/rollouts/r1/tokenize", content=b"{nope")

    assert_openai_error(answer, 400, "invalid_json")
    assert gw.engine.requests == []
