"""Exact mode's protocol against a scripted engine: one render, then vLLM's own chat endpoint with the prompt
given as ids, whatever the reply's form (whole, streamed, several choices); what vLLM answers is relayed as in
pass-through, and the turn says when vLLM did not take the ids."""

from __future__ import annotations

import orjson
import pytest

from gateway.turns.exact import RENDER

from support.fake_engine import chat_completion, chat_reply, chat_stream, json_reply

pytestmark = pytest.mark.anyio

PROMPT = [1, 10, 11, 2, 1, 30]
CHAT = "/v1/chat/completions"


async def exact_gateway(start):  # type: ignore[no-untyped-def]
    gw = await start(mode="exact")
    gw.engine.exact = True
    gw.engine.answer(RENDER, json_reply({"token_ids": PROMPT, "sampling_params": {"max_tokens": 16}}))
    return gw


async def test_a_streamed_exact_reply_is_one_render_and_vllms_own_chat_stream_relayed(start):
    gw = await exact_gateway(start)
    gw.engine.answer(CHAT, chat_stream(PROMPT, [(5, "a"), (6, "b"), (2, "")]))

    response = await gw.chat("r1", stream=True, kv_transfer_params={"do_remote_decode": False})

    assert response.status_code == 200
    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "a", "b", ""]
    assert [c["choices"][0].get("token_ids") for c in chunks[1:]] == [None, None, None]  # not asked for
    (render, _), (path, sent) = gw.engine.requests
    assert (render, path) == (RENDER, CHAT)
    assert sent["kv_transfer_params"] == {"do_remote_decode": False, "prompt_token_ids": PROMPT}
    assert (sent["stream"], sent["return_token_ids"], sent["logprobs"]) == (True, True, True)
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["prompt_token_ids"], turn["completion_token_ids"]) == (PROMPT, [5, 6, 2])
    assert (turn["content"], turn["finish_reason"], turn["splice"]) == ("ab", "stop", "render")
    assert turn["completion_logprobs"] == [-0.25, -0.5, -0.75]


async def test_a_whole_exact_reply_is_vllms_own_chat_reply(start):
    gw = await exact_gateway(start)
    gw.engine.answer(CHAT, chat_reply(PROMPT, [40, 41, 2], "hi"))

    response = await gw.chat("r1")

    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "hi"
    assert [path for path, _ in gw.engine.requests] == [RENDER, CHAT]
    assert gw.engine.requests[1][1]["kv_transfer_params"] == {"prompt_token_ids": PROMPT}
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["prompt_token_ids"], turn["completion_token_ids"], turn["splice"]) == (
        PROMPT,
        [40, 41, 2],
        "render",
    )


async def test_several_choices_in_exact_mode_are_one_render_and_a_turn_each(start):
    gw = await exact_gateway(start)
    reply = chat_completion(PROMPT, [40, 2], "one")
    second = {**reply["choices"][0], "index": 1, "token_ids": [41, 42, 2]}
    second["message"] = {**second["message"], "content": "two"}
    second["logprobs"] = {"content": [{"token": "t", "logprob": -1.0}] * 3}
    reply["choices"].append(second)
    gw.engine.answer(CHAT, json_reply(reply))

    response = await gw.chat("r1", n=2)

    assert [c["message"]["content"] for c in response.json()["choices"]] == ["one", "two"]
    assert [path for path, _ in gw.engine.requests] == [RENDER, CHAT]
    turns = (await gw.rollout("r1"))["turns"]
    assert [(t["choice_index"], t["prompt_token_ids"], t["completion_token_ids"]) for t in turns] == [
        (0, PROMPT, [40, 2]),
        (1, PROMPT, [41, 42, 2]),
    ]
    assert [t["splice"] for t in turns] == ["render", "render"]


async def test_a_reply_whose_prompt_is_not_the_one_given_records_that_vllm_rendered_it(start):
    gw = await exact_gateway(start)
    rendered_by_vllm = [1, 10, 11, 2, 1, 30, 99]  # vLLM renders the messages itself for echo and media
    gw.engine.answer(CHAT, chat_reply(rendered_by_vllm, [40, 2], "hi"))

    response = await gw.chat("r1")

    assert response.status_code == 200
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert turn["prompt_token_ids"] == rendered_by_vllm  # the ids the engine saw, always
    assert turn["splice"] == "fallback: vLLM rendered the messages itself"
