"""Exact mode's streamed path against a scripted engine: the protocol of vLLM's stateless streaming derender
(one call per engine step, the stream state threaded through, the end of the reply as a call of its own)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from fake_engine import generate_stream, json_reply

from gateway.turns.exact import DERENDER, GENERATE, RENDER

pytestmark = pytest.mark.anyio

PROMPT = [1, 10, 11, 2, 1, 30]
EOS = 2


def derender_answer(step: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    chunk = {
        "id": "gen-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return {"chunk": chunk, "stream_state": {"step": step}}


async def test_streamed_exact_reply_derenders_each_engine_step_then_the_finish_on_its_own(start):
    gw = await start(mode="exact")
    gw.engine.exact = True
    gw.engine.answer(RENDER, json_reply({"token_ids": PROMPT, "sampling_params": {"max_tokens": 16}}))
    # Three engine steps: two tokens arrive together, then one, then the end-of-sequence token alone.
    gw.engine.answer(GENERATE, generate_stream(PROMPT, [[5, 6], [7], [EOS]]))
    for step, (delta, finish) in enumerate(
        [({"role": "assistant", "content": "ab"}, None), ({"content": "c"}, None), ({}, "stop")]
    ):
        gw.engine.answer(DERENDER, json_reply(derender_answer(step, delta, finish)))

    response = await gw.chat("r1", stream=True)

    assert response.status_code == 200
    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["ab", "c", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    derenders = [body for path, body in gw.engine.requests if path == DERENDER]
    assert [d["generate_chunk"]["choices"][0]["token_ids"] for d in derenders] == [[5, 6], [7], []]
    assert [d["generate_chunk"]["choices"][0]["finish_reason"] for d in derenders] == [None, None, "stop"]
    assert [d["stream_state"] for d in derenders] == [None, {"step": 0}, {"step": 1}]
    assert all(d["prompt_token_ids"] == PROMPT for d in derenders)
    (turn,) = (await gw.rollout("r1"))["turns"]
    assert (turn["completion_token_ids"], turn["content"], turn["finish_reason"]) == (
        [5, 6, 7, EOS],
        "abc",
        "stop",
    )
    assert turn["completion_logprobs"] == [-0.5] * 4


async def test_streamed_exact_reply_ends_with_the_usage_chunk_the_agent_asked_for(start):
    gw = await start(mode="exact")
    gw.engine.exact = True
    gw.engine.answer(RENDER, json_reply({"token_ids": PROMPT, "sampling_params": {"max_tokens": 16}}))
    gw.engine.answer(GENERATE, generate_stream(PROMPT, [[5, 6], [EOS]]))
    for step, (delta, finish) in enumerate([({"role": "assistant", "content": "ab"}, None), ({}, "stop")]):
        gw.engine.answer(DERENDER, json_reply(derender_answer(step, delta, finish)))

    response = await gw.chat("r1", stream=True, stream_options={"include_usage": True})

    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    usage = orjson.loads(events[-2])
    assert events[-1] == "[DONE]"
    assert (usage["id"], usage["model"], usage["choices"]) == ("gen-1", "tiny", [])
    assert usage["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}


def generate_whole(token_ids: list[int]) -> dict[str, Any]:
    logprobs = [{"token": f"token_id:{t}", "logprob": -0.5} for t in token_ids]
    choice = {"index": 0, "token_ids": token_ids, "logprobs": {"content": logprobs}, "finish_reason": "stop"}
    return {"request_id": "gen-1", "choices": [choice]}


def derendered_calls(*ids: str) -> dict[str, Any]:
    calls = [
        {"id": call_id, "type": "function", "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}
        for call_id in ids
    ]
    message = {"role": "assistant", "content": None, "tool_calls": calls}
    return {
        "id": "gen-1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
    }


@pytest.mark.parametrize(
    ("parser_ids", "expected"),
    [
        (["Ab3dE6gH9", "Zz1yX2wV3"], ["Ab3dE6gH9", "Zz1yX2wV3"]),  # the parser's own (Mistral-style) ids
        ([], ["chatcmpl-tool-9f2c", "chatcmpl-tool-77aa"]),  # none from one chunk: vLLM's default format
    ],
    ids=["parser ids", "default format"],
)
async def test_whole_exact_reply_carries_the_tool_call_ids_vllms_chat_would(start, parser_ids, expected):
    gw = await start(mode="exact")
    gw.engine.exact = True
    gw.engine.answer(RENDER, json_reply({"token_ids": PROMPT, "sampling_params": {}}))
    gw.engine.answer(GENERATE, json_reply(generate_whole([40, 41, EOS])))
    gw.engine.answer(DERENDER, json_reply(derendered_calls("9f2c", "77aa")))
    pieces = [{"index": i, "id": call_id, "type": "function"} for i, call_id in enumerate(parser_ids)]
    gw.engine.answer(DERENDER, json_reply(derender_answer(0, {"tool_calls": pieces}, "tool_calls")))

    response = await gw.chat("r1")

    assert response.status_code == 200, response.text
    assert [c["id"] for c in response.json()["choices"][0]["message"]["tool_calls"]] == expected
    whole, one_chunk = [body for path, body in gw.engine.requests if path == DERENDER]
    assert whole["generate_response"]["choices"][0]["token_ids"] == [40, 41]  # the end token left out
    assert (one_chunk["stream"], one_chunk["generate_chunk"]["choices"][0]["token_ids"]) == (True, [40, 41])
    (turn,) = (await gw.rollout("r1", include_messages="true"))["turns"]
    assert [c["id"] for c in turn["tool_calls"]] == expected
